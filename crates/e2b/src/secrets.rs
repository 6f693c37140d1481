//! E2B's secrets (`/secrets`): the account's secrets, as the SDKs' `Secret`
//! class makes, lists, reads, updates and deletes them. They are the same
//! secrets as the REST API's (see `sandpit_core`'s `Secrets`): this module
//! only maps E2B's wire shapes onto those calls, and pages the list.

use crate::control::Authed;
use crate::error::{Body, HttpError};
use crate::E2b;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

type Answer = Result<Response, HttpError>;

/// The routes (merged into the control plane).
pub fn routes() -> Router<E2b> {
    Router::new()
        .route("/secrets", get(list).post(create))
        .route(
            "/secrets/{secret}",
            get(get_info).post(update).delete(delete),
        )
}

/// A secret as E2B shows it (`Secret`): never its value.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct SecretInfo {
    #[serde(rename = "secretID")]
    secret_id: String,
    name: String,
    current_version: i64,
    metadata: BTreeMap<String, String>,
    created_at: String,
    updated_at: String,
}

impl From<sandpit_core::Secret> for SecretInfo {
    fn from(s: sandpit_core::Secret) -> SecretInfo {
        SecretInfo {
            secret_id: s.id,
            name: s.name,
            current_version: s.version,
            metadata: s.metadata,
            created_at: s.created_at,
            updated_at: s.updated_at,
        }
    }
}

/// `POST /secrets` (`NewSecret`).
#[derive(Deserialize)]
struct NewSecret {
    name: String,
    value: String,
    metadata: Option<BTreeMap<String, String>>,
}

/// `POST /secrets/{secretID}` (`SecretUpdate`).
#[derive(Deserialize)]
struct SecretUpdate {
    value: String,
    metadata: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    limit: Option<u32>,
    next_token: Option<String>,
}

/// E2B's 404 for a secret, as its SDKs look for it.
fn not_found(e: sandpit_core::CoreError, secret: &str) -> HttpError {
    match e.kind {
        sandpit_core::ErrorType::NotFound => {
            HttpError::new(StatusCode::NOT_FOUND, format!("Secret {secret} not found"))
        }
        _ => e.into(),
    }
}

/// `GET /secrets`: by name, `limit` at a time (at most 100); `X-Next-Token`
/// is the last name of the page when more follow.
async fn list(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Query(q): Query<ListQuery>,
) -> Answer {
    let limit = q.limit.unwrap_or(100).clamp(1, 100) as usize;
    let all = e2b.api.list_secrets(&caller).await?.data;
    let after = q.next_token.filter(|t| !t.is_empty());
    let mut page: Vec<sandpit_core::Secret> = all
        .into_iter()
        .filter(|s| after.as_ref().is_none_or(|a| s.name.as_str() > a.as_str()))
        .take(limit + 1)
        .collect();
    let more = page.len() > limit;
    page.truncate(limit);
    let next = more.then(|| page.last().map(|s| s.name.clone())).flatten();
    let shown: Vec<SecretInfo> = page.into_iter().map(SecretInfo::from).collect();
    Ok(crate::control::paged(shown, next))
}

async fn create(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Body(body): Body<NewSecret>,
) -> Answer {
    let made = e2b
        .api
        .create_secret(
            &caller,
            &body.name,
            body.value,
            body.metadata.unwrap_or_default(),
        )
        .await?;
    Ok((StatusCode::CREATED, Json(SecretInfo::from(made))).into_response())
}

async fn get_info(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(secret): Path<String>,
) -> Answer {
    let found = e2b
        .api
        .get_secret(&caller, &secret)
        .await
        .map_err(|e| not_found(e, &secret))?;
    Ok(Json(SecretInfo::from(found)).into_response())
}

async fn update(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(secret): Path<String>,
    Body(body): Body<SecretUpdate>,
) -> Answer {
    let updated = e2b
        .api
        .update_secret(&caller, &secret, body.value, body.metadata)
        .await
        .map_err(|e| not_found(e, &secret))?;
    Ok(Json(SecretInfo::from(updated)).into_response())
}

async fn delete(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(secret): Path<String>,
) -> Answer {
    e2b.api
        .delete_secret(&caller, &secret)
        .await
        .map_err(|e| not_found(e, &secret))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
