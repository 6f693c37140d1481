//! `filesystem.Filesystem`: describing, listing, making, moving and
//! removing paths, as the guest user (the guest's kernel decides what the
//! user may do), over the core's files (`list_files`, `delete_file`,
//! `path_call`). Paths that are not absolute are under the user's home.
//! Watching a directory is [`super::watch`]'s.

use super::connect;
use super::{check_user, guest_path, named_user, ForSandbox};
use crate::error::RpcError;
use crate::E2b;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use sandpit_core::{EntryType, ErrorType};
use sandpit_protocol::{FileKind, PathCall, PathEntry};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct Request {
    path: String,
    depth: Option<u32>,
    source: String,
    destination: String,
}

/// `POST /filesystem.Filesystem/{method}`.
pub async fn call(
    State(e2b): State<E2b>,
    sandbox: ForSandbox,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match answer(&e2b, &sandbox, &method, &headers, &body).await {
        Ok(message) => (StatusCode::OK, axum::Json(message)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn answer(
    e2b: &E2b,
    sandbox: &ForSandbox,
    method: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Value, RpcError> {
    if matches!(
        method,
        "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher"
    ) {
        return super::watch::polled(e2b, sandbox, method, headers, body).await;
    }
    check_user(named_user(headers).as_deref())?;
    let req: Request = connect::request(headers, body)?;
    let call = |call: PathCall| async {
        e2b.api
            .path_call(&sandbox.caller, &sandbox.id, call)
            .await
            .map_err(file_error)
    };
    match method {
        "Stat" => {
            let entry = call(PathCall::Stat {
                path: guest_path(&req.path),
            })
            .await?;
            Ok(json!({"entry": entry_info(&entry)}))
        }
        "MakeDir" => {
            let made = e2b
                .api
                .path_call(
                    &sandbox.caller,
                    &sandbox.id,
                    PathCall::MakeDir {
                        path: guest_path(&req.path),
                    },
                )
                .await;
            match made {
                Ok(entry) => Ok(json!({"entry": entry_info(&entry)})),
                Err(e) if e.kind == ErrorType::Conflict => {
                    Err(RpcError::new("already_exists", e.message))
                }
                Err(e) => Err(file_error(e)),
            }
        }
        "Move" => {
            let entry = call(PathCall::Move {
                from: guest_path(&req.source),
                to: guest_path(&req.destination),
            })
            .await?;
            Ok(json!({"entry": entry_info(&entry)}))
        }
        "Remove" => {
            e2b.api
                .delete_file(&sandbox.caller, &sandbox.id, &guest_path(&req.path), true)
                .await
                .map_err(file_error)?;
            Ok(json!({}))
        }
        "ListDir" => list(e2b, sandbox, &req).await,
        other => Err(RpcError::unimplemented(&format!(
            "filesystem.Filesystem/{other}"
        ))),
    }
}

/// `ListDir`: the entries `depth` levels down (1: the directory's own).
async fn list(e2b: &E2b, sandbox: &ForSandbox, req: &Request) -> Result<Value, RpcError> {
    let depth = req.depth.unwrap_or(1).max(1) as usize;
    let path = guest_path(&req.path);
    let dir = e2b
        .api
        .path_call(
            &sandbox.caller,
            &sandbox.id,
            PathCall::Stat { path: path.clone() },
        )
        .await
        .map_err(file_error)?;
    if dir.kind != FileKind::Dir {
        return Err(RpcError::invalid(format!("{path} is not a directory")));
    }
    let listing = e2b
        .api
        .list_files(&sandbox.caller, &sandbox.id, Some(&path), depth > 1)
        .await
        .map_err(file_error)?;
    if listing.truncated {
        return Err(RpcError::new(
            "resource_exhausted",
            format!("{path} holds more entries than one answer carries; list a smaller depth"),
        ));
    }
    let base = listing.path.trim_end_matches('/');
    let entries: Vec<Value> = listing
        .entries
        .iter()
        .filter(|e| e.name.split('/').count() <= depth)
        .map(|e| {
            let name = e.name.rsplit('/').next().unwrap_or(&e.name);
            json!({
                "name": name,
                "type": file_type(match e.kind {
                    EntryType::File => FileKind::File,
                    EntryType::Dir => FileKind::Dir,
                    EntryType::Symlink => FileKind::Symlink,
                    EntryType::Other => FileKind::Other,
                }),
                "path": format!("{base}/{}", e.name),
                "size": e.size_bytes.to_string(),
            })
        })
        .collect();
    Ok(json!({"entries": entries}))
}

/// A file call's failure: not found is the filesystem's `not_found`.
fn file_error(e: sandpit_core::CoreError) -> RpcError {
    e.into()
}

fn file_type(kind: FileKind) -> &'static str {
    match kind {
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    }
}

/// envd's `EntryInfo` (protobuf JSON: int64 as a string, the timestamp as
/// RFC 3339).
fn entry_info(e: &PathEntry) -> Value {
    let modified =
        time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(e.modified_unix_ms) * 1_000_000)
            .ok()
            .and_then(|t| {
                t.format(&time::format_description::well_known::Rfc3339)
                    .ok()
            });
    let mut info = json!({
        "name": e.name,
        "type": file_type(e.kind),
        "path": e.path,
        "size": e.size_bytes.to_string(),
        "mode": e.mode,
        "permissions": permissions(e.kind, e.mode),
        "owner": e.owner,
        "group": e.group,
        "isSymlink": e.kind == FileKind::Symlink,
    });
    if let Some(m) = modified {
        info["modifiedTime"] = json!(m);
    }
    if let Some(target) = &e.symlink_target {
        info["symlinkTarget"] = json!(target);
    }
    info
}

/// `ls -l`'s spelling of a mode: `drwxr-xr-x`.
fn permissions(kind: FileKind, mode: u32) -> String {
    let mut s = String::from(match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'l',
        FileKind::File | FileKind::Other => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_are_spelled_as_ls_does() {
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FileKind::File, 0o640), "-rw-r-----");
        assert_eq!(permissions(FileKind::Symlink, 0o777), "lrwxrwxrwx");
    }
}
