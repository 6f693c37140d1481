//! A sandbox's file browser: a directory's entries (directories to open,
//! files to download), uploads into it and deletes, over the same file
//! calls as the API, as the signed-in account.
//!
//! Downloads stream as the guest sends them. An upload comes as a
//! multipart form, which carries no size before its bytes, and the guest
//! is told a file's size first: so a file is taken whole (at most
//! [`MAX_UPLOAD`]) and then written; bigger files go through the API's
//! streamed `PUT` or `sandpit sandbox cp`.

use crate::pages::kind_word;
use crate::session::Signed;
use crate::view::PageForm;
use crate::view::{self, Failure};
use crate::Web;
use axum::body::Body;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use futures::StreamExt;
use maud::{html, Markup};
use sandpit_core::{EntryType, FileList};
use serde::Deserialize;

/// The largest file the browser's upload form takes.
pub const MAX_UPLOAD: usize = 64 << 20;

/// The parent of a guest directory (`/` for `/`).
fn parent(dir: &str) -> &str {
    match dir.trim_end_matches('/').rsplit_once('/') {
        Some(("", _)) | None => "/",
        Some((p, _)) => p,
    }
}

fn join(dir: &str, name: &str) -> String {
    format!("{}/{name}", dir.trim_end_matches('/'))
}

/// The directory's listing with its links and forms.
pub(crate) fn browser(id: &str, list: &FileList, csrf: &str) -> Markup {
    let here = list.path.as_str();
    let open = |p: &str| format!("/sandboxes/{id}?path={}#files", view::url_encode(p));
    html! {
        p { "In " code { (here) } @if here != "/" { " · " a href=(open(parent(here))) { "Up" } } }
        div class="scroll" { table {
            thead { tr { th scope="col" { "Name" } th scope="col" { "Kind" } th scope="col" { "Size" } th scope="col" { "" } } }
            tbody {
                @for e in &list.entries {
                    @let path = join(here, &e.name);
                    tr {
                        td {
                            @match e.kind {
                                EntryType::Dir => a href=(open(&path)) { (e.name) "/" },
                                EntryType::File => a href={ "/sandboxes/" (id) "/files/download?path=" (view::url_encode(&path)) } download=(e.name) { (e.name) },
                                _ => (e.name),
                            }
                        }
                        td { (kind_word(&e.kind)) }
                        td class="num" { @if e.kind == EntryType::File { (view::bytes(e.size_bytes)) } }
                        td {
                            form class="inline" method="post" action={ "/sandboxes/" (id) "/files/delete" } {
                                input type="hidden" name="csrf" value=(csrf);
                                input type="hidden" name="path" value=(path);
                                @if e.kind == EntryType::Dir { input type="hidden" name="recursive" value="true"; }
                                button type="submit" class="danger small" aria-label={ "Delete " (e.name) } { "Delete" }
                            }
                        }
                    }
                }
            }
        } }
        @if list.truncated { p class="muted" { "The listing was cut at its limit." } }
        form class="row" method="post" enctype="multipart/form-data" action={ "/sandboxes/" (id) "/files/upload" } {
            input type="hidden" name="csrf" value=(csrf);
            input type="hidden" name="dir" value=(here);
            div class="grow" {
                label for="upload" { "Upload a file here (up to " (view::bytes(MAX_UPLOAD as u64)) ")" }
                input id="upload" name="file" type="file" required;
            }
            div { button type="submit" { "Upload" } }
        }
    }
}

#[derive(Deserialize)]
pub(crate) struct PathQuery {
    path: String,
}

/// `GET /sandboxes/{id}/files/download?path=`: the file, streamed.
pub(crate) async fn download(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> Result<Response, Failure> {
    let file = web.api.download_file(&signed.caller, &id, &q.path).await?;
    let name = file
        .path
        .rsplit('/')
        .next()
        .filter(|n| !n.is_empty())
        .unwrap_or("download")
        .to_string();
    let stream =
        tokio_stream(file.chunks).map(|piece| piece.map_err(|e| std::io::Error::other(e.message)));
    let ascii: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() && c != '"' && c != '\\' {
                c
            } else {
                '_'
            }
        })
        .collect();
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, file.size.to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!(
                    "attachment; filename=\"{ascii}\"; filename*=UTF-8''{}",
                    view::url_encode(&name).replace('/', "%2F")
                ),
            ),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// A receiver as a stream.
fn tokio_stream<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// `POST /sandboxes/{id}/files/upload` (multipart: `csrf`, `dir`, `file`).
pub(crate) async fn upload(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    mut form: Multipart,
) -> Result<Response, Failure> {
    let bad = |m: String| Failure::new(StatusCode::BAD_REQUEST, m);
    let (mut csrf_ok, mut dir, mut file) = (false, None::<String>, None::<(String, Vec<u8>)>);
    while let Some(mut field) = form
        .next_field()
        .await
        .map_err(|e| bad(format!("The upload did not arrive whole: {e}")))?
    {
        match field.name() {
            Some("csrf") => {
                let t = field.text().await.map_err(|e| bad(e.to_string()))?;
                signed.check_csrf(&t)?;
                csrf_ok = true;
            }
            Some("dir") => dir = Some(field.text().await.map_err(|e| bad(e.to_string()))?),
            Some("file") => {
                // The form is checked before any of the file is taken.
                if !csrf_ok {
                    return Err(bad("The form's fields came in the wrong order.".into()));
                }
                let name = field.file_name().unwrap_or("upload").to_string();
                let mut bytes = Vec::new();
                while let Some(piece) = field
                    .chunk()
                    .await
                    .map_err(|e| bad(format!("The upload did not arrive whole: {e}")))?
                {
                    if bytes.len() + piece.len() > MAX_UPLOAD {
                        return Err(Failure::new(
                            StatusCode::PAYLOAD_TOO_LARGE,
                            format!(
                                "The file is over {}: copy it with `sandpit sandbox cp` or the API's PUT.",
                                view::bytes(MAX_UPLOAD as u64)
                            ),
                        ));
                    }
                    bytes.extend_from_slice(&piece);
                }
                file = Some((name, bytes));
            }
            _ => {}
        }
    }
    if !csrf_ok {
        return Err(Failure::new(
            StatusCode::FORBIDDEN,
            "The form carried no CSRF token: reload the page and try again.",
        ));
    }
    let (name, bytes) = file.ok_or_else(|| bad("Choose a file to upload.".into()))?;
    // Only the file's own name: a name cannot climb out of the directory.
    let name = name
        .rsplit(['/', '\\'])
        .next()
        .unwrap_or("upload")
        .to_string();
    if name.is_empty() || name == "." || name == ".." {
        return Err(bad(format!("{name:?} is not a file name.")));
    }
    let dir = dir.unwrap_or_else(|| "/workspace".into());
    let path = join(&dir, &name);
    let size = bytes.len() as u64;
    web.api
        .upload_file(
            &signed.caller,
            &id,
            &path,
            size,
            Box::new(Whole(Some(bytes))),
        )
        .await?;
    Ok(Redirect::to(&format!(
        "/sandboxes/{id}?path={}#files",
        view::url_encode(&dir)
    ))
    .into_response())
}

/// A body that is already all here.
struct Whole(Option<Vec<u8>>);

#[async_trait::async_trait]
impl sandpit_core::api::ByteSource for Whole {
    async fn next_chunk(&mut self) -> Option<std::io::Result<Vec<u8>>> {
        self.0.take().map(Ok)
    }
}

#[derive(Deserialize)]
pub(crate) struct DeleteForm {
    /// Absent: refused as a wrong token is (403), not as a malformed form.
    #[serde(default)]
    csrf: String,
    path: String,
    #[serde(default)]
    recursive: Option<String>,
}

/// `POST /sandboxes/{id}/files/delete`.
pub(crate) async fn delete(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    PageForm(f): PageForm<DeleteForm>,
) -> Result<Response, Failure> {
    signed.check_csrf(&f.csrf)?;
    let recursive = f.recursive.is_some();
    let done = web
        .api
        .delete_file(&signed.caller, &id, &f.path, recursive)
        .await?;
    let dir = parent(&done.path).to_string();
    Ok(Redirect::to(&format!(
        "/sandboxes/{id}?path={}#files",
        view::url_encode(&dir)
    ))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_climb_and_join() {
        assert_eq!(parent("/workspace/a"), "/workspace");
        assert_eq!(parent("/workspace"), "/");
        assert_eq!(parent("/"), "/");
        assert_eq!(join("/", "etc"), "/etc");
        assert_eq!(join("/workspace/", "f"), "/workspace/f");
    }
}
