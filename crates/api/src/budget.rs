//! How many request bodies the server holds at once, in bytes.
//!
//! A body is read whole before its handler runs (a file write is JSON with
//! the file inside, up to `max_body_bytes`), so a hundred parallel uploads
//! are a hundred bodies in memory, and then their parsed and decoded copies.
//! Every request that carries a body first takes its size (its
//! `Content-Length`; `max_body_bytes` when it does not say) from one budget
//! shared by REST and MCP, and gives it back when its response is ready.
//! A request that cannot get its share within [`BUDGET_WAIT`] is answered
//! 503 before anything of its body is read.

use crate::error::ApiError;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sandpit_core::{CoreError, ErrorType};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// How long a request waits for its share of the budget.
pub const BUDGET_WAIT: Duration = Duration::from_secs(30);

/// The budget's unit: permits are KiB, so a budget of terabytes still fits.
const UNIT: usize = 1024;

/// The bytes of request bodies in memory at once, shared by the REST routes
/// and MCP's endpoint (see `router` and `with_request_layers`).
#[derive(Debug, Clone)]
pub struct BodyBudget {
    permits: Arc<Semaphore>,
    total: usize,
    /// What a body that does not say its length is counted as.
    max_body_bytes: usize,
}

impl BodyBudget {
    /// A budget of `total` bytes for bodies of at most `max_body_bytes`.
    pub fn new(total: usize, max_body_bytes: usize) -> BodyBudget {
        let total = total.max(max_body_bytes);
        BodyBudget {
            permits: Arc::new(Semaphore::new(total.div_ceil(UNIT))),
            total,
            max_body_bytes,
        }
    }

    /// Bytes of the budget free now.
    pub fn available(&self) -> usize {
        self.permits.available_permits() * UNIT
    }

    /// The share of a request: what its body may take.
    fn share(&self, req: &Request) -> usize {
        if crate::raw::streams_body(req) {
            return 0;
        }
        let declared = req
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
        match declared {
            Some(n) => n.min(self.max_body_bytes),
            None if req
                .headers()
                .contains_key(axum::http::header::TRANSFER_ENCODING) =>
            {
                self.max_body_bytes
            }
            None => 0,
        }
    }
}

pub(crate) async fn hold(State(budget): State<BodyBudget>, req: Request, next: Next) -> Response {
    let share = budget.share(&req);
    if share == 0 {
        return next.run(req).await;
    }
    let units = share.div_ceil(UNIT) as u32;
    match tokio::time::timeout(
        BUDGET_WAIT,
        budget.permits.clone().acquire_many_owned(units),
    )
    .await
    {
        Ok(Ok(_held)) => next.run(req).await,
        _ => ApiError::from(CoreError::new(
            ErrorType::ServiceUnavailable,
            format!(
                "the server is receiving {} MiB of request bodies already, its most; retry",
                budget.total >> 20
            ),
        ))
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_counts_as_its_length_or_the_most_when_unsaid() {
        let b = BodyBudget::new(10 << 20, 4 << 20);
        let req = |h: &[(&str, &str)]| {
            let mut r = Request::builder().method("PUT").uri("/");
            for (k, v) in h {
                r = r.header(*k, *v);
            }
            r.body(axum::body::Body::empty()).unwrap()
        };
        assert_eq!(b.share(&req(&[("content-length", "1000")])), 1000);
        assert_eq!(b.share(&req(&[("content-length", "999999999")])), 4 << 20);
        assert_eq!(b.share(&req(&[("transfer-encoding", "chunked")])), 4 << 20);
        assert_eq!(b.share(&req(&[])), 0);
        // Never smaller than one whole body.
        assert_eq!(BodyBudget::new(1, 4 << 20).total, 4 << 20);
    }
}
