//! Extractors that fail with the API's JSON errors instead of axum's plain
//! text, and that are strict: a body or query with a field the endpoint does
//! not know is `invalid_request` (a typo such as `timeout_minute` must not
//! silently fall back to a default and bill the wrong lifetime).

use crate::error::{ApiError, RequestId};
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use sandpit_core::{Caller, CoreError, ErrorType};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;

/// The authenticated caller. Runs before anything reads the body, so an
/// unauthenticated request is always 401 whatever else is wrong with it.
pub(crate) struct Authed(pub Caller);

/// Query parameters that look like an API key. A key in the URL ends up in
/// proxy and server logs, so it is refused even next to a valid header.
const KEY_PARAMS: &[&str] = &[
    "api_key",
    "apikey",
    "api-key",
    "key",
    "x-api-key",
    "x_api_key",
    "access_token",
    "token",
    "authorization",
    "auth",
];

impl FromRequestParts<AppState> for Authed {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        if let Some(q) = parts.uri.query() {
            if let Some((name, _)) = form_urlencoded::parse(q.as_bytes())
                .find(|(k, _)| KEY_PARAMS.contains(&k.to_ascii_lowercase().as_str()))
            {
                return Err(CoreError::new(
                    ErrorType::Unauthorized,
                    format!(
                        "API keys are never accepted in the URL (query parameter `{name}`): \
                         send `Authorization: Bearer <key>` or `x-api-key: <key>`, \
                         and treat a key that was put in a URL as exposed"
                    ),
                )
                .into());
            }
        }
        let key = key_from_headers(parts)?;
        let caller = state.api.authenticate(&key).await?;
        Ok(Authed(caller))
    }
}

fn key_from_headers(parts: &Parts) -> Result<String, ApiError> {
    Ok(sandpit_core::api::api_key_from_headers(
        parts
            .headers
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes()),
        parts.headers.get("x-api-key").map(|v| v.as_bytes()),
    )?)
}

/// This request's id (minted by the outermost middleware).
pub(crate) struct ReqId(pub String);

impl<S: Send + Sync> FromRequestParts<S> for ReqId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let id = parts
            .extensions
            .get::<RequestId>()
            .map(|r| r.0.clone())
            .unwrap_or_default();
        Ok(ReqId(id))
    }
}

/// A JSON body: `Content-Type: application/json`, no unknown fields. An empty
/// body is read as `{}` (every field has its default; a required field is
/// then reported missing by name).
pub(crate) struct JsonBody<T>(pub T);

impl<T> FromRequest<AppState> for JsonBody<T>
where
    T: DeserializeOwned + JsonSchema,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let content_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let limit = state.cfg.max_body_bytes;
        let bytes = Bytes::from_request(req, state).await.map_err(|rej| {
            if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::invalid(format!(
                    "request body too large: the limit is {limit} bytes ({})",
                    human_bytes(limit)
                ))
                .with_status(StatusCode::PAYLOAD_TOO_LARGE)
            } else {
                ApiError::invalid(format!("could not read the request body: {rej}"))
            }
        })?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return parse_json(b"{}").map(JsonBody);
        }
        match content_type.as_deref() {
            Some(ct) if is_json(ct) => {}
            Some(ct) => {
                return Err(ApiError::invalid(format!(
                    "unsupported Content-Type `{ct}`: the body must be JSON sent as `Content-Type: application/json`"
                )))
            }
            None => {
                return Err(ApiError::invalid(
                    "missing Content-Type: the body must be JSON sent as `Content-Type: application/json`",
                ))
            }
        }
        parse_json(&bytes).map(JsonBody)
    }
}

fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

fn human_bytes(n: usize) -> String {
    const MIB: usize = 1024 * 1024;
    if n >= MIB && n.is_multiple_of(MIB) {
        format!("{} MiB", n / MIB)
    } else if n >= 1024 && n.is_multiple_of(1024) {
        format!("{} KiB", n / 1024)
    } else {
        format!("{n} B")
    }
}

/// Parse a JSON body strictly (no unknown fields, no trailing data).
pub(crate) fn parse_json<T: DeserializeOwned + JsonSchema>(bytes: &[u8]) -> Result<T, ApiError> {
    // serde would also take a struct as an array of its fields in order; the API takes objects only.
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some_and(|&b| b != b'{') {
        return Err(ApiError::invalid(
            if serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_ok() {
                "invalid body: expected a JSON object".to_owned()
            } else {
                "malformed JSON body: expected a JSON object".to_owned()
            },
        ));
    }
    let mut unknown = Vec::new();
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(serde_ignored::Deserializer::new(
        &mut de,
        &mut |path: serde_ignored::Path| unknown.push(path.to_string()),
    ));
    let value = match parsed {
        Ok(v) => v,
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            return Err(match inner.classify() {
                serde_json::error::Category::Data if path != "." => {
                    ApiError::invalid(format!("invalid body field `{path}`: {inner}"))
                }
                serde_json::error::Category::Data => {
                    ApiError::invalid(format!("invalid body: {inner}"))
                }
                _ => ApiError::invalid(format!("malformed JSON body: {inner}")),
            });
        }
    };
    de.end()
        .map_err(|e| ApiError::invalid(format!("malformed JSON body: {e}")))?;
    if let Some(field) = unknown.first() {
        return Err(ApiError::invalid(format!(
            "unknown body field `{field}`; accepted fields: {}",
            accepted_fields::<T>()
        )));
    }
    Ok(value)
}

/// [`parse_json`] outside this crate (the fuzz targets in `fuzz/`): what a
/// handler makes of a JSON body, or the error the client is sent.
pub fn parse_json_body<T: DeserializeOwned + JsonSchema>(bytes: &[u8]) -> Result<T, CoreError> {
    parse_json(bytes).map_err(|e| e.err)
}

/// [`parse_query`] outside this crate (the fuzz targets in `fuzz/`).
pub fn parse_query_string<T: DeserializeOwned + JsonSchema>(query: &str) -> Result<T, CoreError> {
    parse_query(query).map_err(|e| e.err)
}

/// Query parameters, strictly: unknown parameters and bad values are
/// `invalid_request` naming the parameter.
pub(crate) struct QueryParams<T>(pub T);

impl<T, S> FromRequestParts<S> for QueryParams<T>
where
    T: DeserializeOwned + JsonSchema,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        parse_query(parts.uri.query().unwrap_or("")).map(QueryParams)
    }
}

pub(crate) fn parse_query<T: DeserializeOwned + JsonSchema>(query: &str) -> Result<T, ApiError> {
    let mut unknown = Vec::new();
    let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
    let parsed: Result<T, _> = serde_path_to_error::deserialize(serde_ignored::Deserializer::new(
        de,
        &mut |path: serde_ignored::Path| unknown.push(path.to_string()),
    ));
    let value = parsed.map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::invalid(format!("invalid query string: {inner}"))
        } else {
            ApiError::invalid(format!("invalid query parameter `{path}`: {inner}"))
        }
    })?;
    if let Some(name) = unknown.first() {
        return Err(ApiError::invalid(format!(
            "unknown query parameter `{name}`; accepted: {}",
            accepted_fields::<T>()
        )));
    }
    Ok(value)
}

/// The property names of `T`'s schema, for "accepted fields" messages.
fn accepted_fields<T: JsonSchema>() -> String {
    let schema = schemars::SchemaGenerator::default().into_root_schema_for::<T>();
    let names: Vec<String> = schema
        .get("properties")
        .and_then(|p| p.as_object())
        .map(|p| p.keys().map(|k| format!("`{k}`")).collect())
        .unwrap_or_default();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandpit_core::CreateSandbox;

    #[test]
    fn json_messages_name_the_problem() {
        let e = parse_json::<CreateSandbox>(b"{\"size\": 3}").unwrap_err();
        assert!(e.err.message.contains("`size`"), "{}", e.err.message);
        let e = parse_json::<sandpit_core::ExecParams>(b"{\"command\": \"x\", \"tmeout_ms\": 1}")
            .unwrap_err();
        assert!(e.err.message.contains("`tmeout_ms`"), "{}", e.err.message);
        assert!(e.err.message.contains("`timeout_ms`"), "{}", e.err.message);
        let e = parse_json::<CreateSandbox>(b"{\"size\": ").unwrap_err();
        assert!(
            e.err.message.starts_with("malformed JSON"),
            "{}",
            e.err.message
        );
        let e = parse_json::<CreateSandbox>(b"[null, null, 5]").unwrap_err();
        assert_eq!(e.err.message, "invalid body: expected a JSON object");
        let e = parse_json::<CreateSandbox>(b"{} {}").unwrap_err();
        assert!(
            e.err.message.starts_with("malformed JSON"),
            "{}",
            e.err.message
        );
    }

    #[test]
    fn query_messages_name_the_parameter() {
        let q: sandpit_core::ListSandboxes = parse_query("limit=5&include_deleted=true").unwrap();
        assert_eq!(q.limit, Some(5));
        assert_eq!(q.include_deleted, Some(true));
        let e = parse_query::<sandpit_core::ListSandboxes>("limit=abc").unwrap_err();
        assert!(e.err.message.contains("`limit`"), "{}", e.err.message);
        let e = parse_query::<sandpit_core::ListSandboxes>("limt=5").unwrap_err();
        assert!(e.err.message.contains("`limt`"), "{}", e.err.message);
    }

    #[test]
    fn content_types() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        assert!(is_json("application/merge-patch+json"));
        assert!(!is_json("text/plain"));
        assert!(!is_json("application/x-www-form-urlencoded"));
        assert_eq!(human_bytes(64 * 1024 * 1024), "64 MiB");
    }
}
