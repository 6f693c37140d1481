//! The dashboard's static files, embedded in the binary: our own
//! stylesheet and script (`static/`), and xterm.js with its fit add-on and
//! stylesheet (from `assets/node_modules`, see `scripts/web-assets.sh`).
//!
//! Each is linked as `/assets/NAME?v=HASH` (its content's hash) and served
//! with a year-long, immutable cache: a new build links new URLs, so no
//! browser keeps an old file, and no page load asks twice.

use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::sync::LazyLock;

struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

const ASSETS: &[Asset] = &[
    Asset {
        name: "app.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../static/app.css"),
    },
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../static/app.js"),
    },
    Asset {
        name: "terminal.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../static/terminal.js"),
    },
    Asset {
        name: "xterm.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../assets/node_modules/@xterm/xterm/lib/xterm.js"),
    },
    Asset {
        name: "xterm.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../assets/node_modules/@xterm/xterm/css/xterm.css"),
    },
    Asset {
        name: "addon-fit.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../assets/node_modules/@xterm/addon-fit/lib/addon-fit.js"),
    },
];

/// Each asset's content hash (16 hex digits), computed once.
static HASHES: LazyLock<Vec<String>> = LazyLock::new(|| {
    ASSETS
        .iter()
        .map(|a| hex::encode(&Sha256::digest(a.body)[..8]))
        .collect()
});

/// The URL a page links `name` by.
pub(crate) fn url(name: &str) -> String {
    let i = ASSETS
        .iter()
        .position(|a| a.name == name)
        .unwrap_or_else(|| panic!("no asset {name}"));
    format!("/assets/{name}?v={}", HASHES[i])
}

pub(crate) async fn serve(Path(file): Path<String>) -> Response {
    match ASSETS.iter().find(|a| a.name == file) {
        Some(a) => (
            [
                (header::CONTENT_TYPE, a.content_type),
                (header::CACHE_CONTROL, "public, max-age=31536000, immutable"),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ],
            a.body,
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "no such asset").into_response(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_asset_is_linked_by_its_content() {
        let a = super::url("xterm.js");
        assert!(
            a.starts_with("/assets/xterm.js?v=") && a.len() == "/assets/xterm.js?v=".len() + 16
        );
        assert_ne!(super::url("app.js"), super::url("terminal.js"));
    }
}
