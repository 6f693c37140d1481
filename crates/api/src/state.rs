//! What every handler of the REST API shares: the [`SandboxApi`] it calls,
//! the HTTP layer's settings and the OpenAPI document it serves.

use crate::budget::BodyBudget;
use sandpit_core::SandboxApi;
use std::sync::Arc;
use std::time::Duration;

/// Settings of the HTTP layer (everything else is the core's).
#[derive(Debug, Clone)]
pub struct RestConfig {
    /// Largest accepted request body; larger is 413. Default 64 MiB, which
    /// fits a 32 MiB file (the read limit) as base64 in a write.
    pub max_body_bytes: usize,
    /// How often an idle exec event stream sends a `: ping` comment. Default 15 s.
    pub sse_ping_interval: Duration,
    /// Request bodies held at once (default 512 MiB; see `BodyBudget`).
    pub body_budget: BodyBudget,
}

/// Default of [`RestConfig::body_budget`]'s total.
pub const DEFAULT_BODY_BUDGET: usize = 512 * 1024 * 1024;

impl Default for RestConfig {
    fn default() -> Self {
        let max_body_bytes = 64 * 1024 * 1024;
        RestConfig {
            max_body_bytes,
            sse_ping_interval: Duration::from_secs(15),
            body_budget: BodyBudget::new(DEFAULT_BODY_BUDGET, max_body_bytes),
        }
    }
}

#[derive(Clone)]
pub(crate) struct AppState {
    pub api: Arc<dyn SandboxApi>,
    pub cfg: Arc<RestConfig>,
    pub openapi: Arc<serde_json::Value>,
}
