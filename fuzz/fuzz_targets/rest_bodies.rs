//! The REST API's request bodies (and the queries of its `GET`s), read and
//! checked as the server does, from arbitrary bytes.
//!
//! Every body goes through `sandpit_api::parse_json_body` (the strict
//! reader behind the handlers' `JsonBody`: objects only, no unknown fields,
//! no trailing data) into its model type, then through the checks the
//! service runs before it reaches the store or a VM
//! (`sandpit_core::service::{check_create, validate_exec, write_content,
//! extension_minutes, check_port, check_path}`), with the default service
//! configuration. The first input byte picks the endpoint, the rest is the
//! body (or the query string).
//!
//! Checked: no panic; every refusal is `invalid_request` with a message; a
//! body that reads, written back with `serde_json` (as `RemoteApi`, the REST
//! client, sends it), reads again as the same value; and what the checks let
//! through is within the limits they stand for (size known, timeouts in
//! range, command and environment within Linux's argument limits, variable
//! names valid, the path resolvable, utf8 content byte for byte).

#![no_main]

use libfuzzer_sys::fuzz_target;
use sandpit_api::{
    parse_json_body, parse_query_string, ExposePortBody, ExtendBody, FilesQuery, UsageQuery,
};
use sandpit_core::config::ServiceConfig;
use sandpit_core::service::{
    check_create, check_path, check_port, extension_minutes, validate_exec, write_content,
};
use sandpit_core::{
    CoreError, CreateSandbox, Encoding, ErrorType, ExecParams, ListSandboxes, WriteFile,
    MAX_COMMAND_BYTES, MAX_ENV_BYTES,
};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fmt::Debug;

fn refused(e: &CoreError) {
    assert_eq!(e.kind, ErrorType::InvalidRequest, "{e:?}");
    assert!(!e.message.is_empty());
}

/// A body as `JsonBody` reads it (blank is `{}`), and read back after
/// `serde_json` writes it.
fn body<T>(bytes: &[u8]) -> Option<T>
where
    T: DeserializeOwned + JsonSchema + Serialize + PartialEq + Debug,
{
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    match parse_json_body::<T>(bytes) {
        Ok(v) => {
            let json = serde_json::to_vec(&v).expect("a request body writes");
            let again = parse_json_body::<T>(&json).unwrap_or_else(|e| {
                panic!(
                    "{v:?} written as {} is refused: {e:?}",
                    String::from_utf8_lossy(&json)
                )
            });
            assert_eq!(again, v);
            Some(v)
        }
        Err(e) => {
            refused(&e);
            None
        }
    }
}

fn query<T: DeserializeOwned + JsonSchema>(bytes: &[u8]) -> Option<T> {
    // A request line's query is text.
    let q = std::str::from_utf8(bytes).ok()?;
    parse_query_string::<T>(q).map_err(|e| refused(&e)).ok()
}

fn checked<T>(r: sandpit_core::error::Result<T>) -> Option<T> {
    r.map_err(|e| refused(&e)).ok()
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let config = ServiceConfig::default();
    match which % 8 {
        0 => {
            let Some(req) = body::<CreateSandbox>(rest) else {
                return;
            };
            if let Some((size, _, timeout)) = checked(check_create(&config, &req, None)) {
                assert!(config.sizes.contains_key(&size));
                assert!((1..=config.max_timeout_minutes).contains(&timeout));
            }
        }
        1 => {
            let Some(p) = body::<ExecParams>(rest) else {
                return;
            };
            let Some(req) = checked(validate_exec(&config, &p)) else {
                return;
            };
            assert_eq!(req.command, p.command);
            assert!(!req.command.trim().is_empty());
            assert!(req.command.len() as u64 <= MAX_COMMAND_BYTES);
            assert!(
                (config.exec_min_timeout_ms..=config.exec_max_timeout_ms).contains(&req.timeout_ms)
            );
            let env_bytes: u64 = req
                .env
                .iter()
                .map(|(k, v)| {
                    let len = (k.len() + 1 + v.len()) as u64;
                    assert!(len <= MAX_COMMAND_BYTES);
                    assert!(!k.is_empty() && !k.as_bytes()[0].is_ascii_digit());
                    assert!(k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
                    len
                })
                .sum();
            assert!(env_bytes <= MAX_ENV_BYTES);
            assert!(req.cwd.as_ref().is_none_or(|c| c.len() <= 4095));
        }
        2 => {
            let Some(req) = body::<WriteFile>(rest) else {
                return;
            };
            let Some((path, bytes)) = checked(write_content(&config, req.clone())) else {
                return;
            };
            assert_eq!(path, req.path);
            assert!(check_path(&path).is_ok());
            assert!(bytes.len() as u64 <= config.max_write_bytes);
            if req.encoding.unwrap_or_default() == Encoding::Utf8 {
                assert_eq!(bytes, req.content.as_bytes());
            }
        }
        3 => {
            if let Some(b) = body::<ExtendBody>(rest) {
                if let Some(add) = checked(extension_minutes(&config, b.additional_minutes)) {
                    assert!(add >= 1);
                }
            }
        }
        4 => {
            if let Some(b) = body::<ExposePortBody>(rest) {
                if checked(check_port(b.port)).is_some() {
                    assert!(b.port >= 1);
                }
            }
        }
        5 => {
            let _ = query::<ListSandboxes>(rest);
        }
        6 => {
            if let Some(q) = query::<FilesQuery>(rest) {
                if let Some(p) = &q.path {
                    let _ = checked(check_path(p));
                }
            }
        }
        _ => {
            let _ = query::<UsageQuery>(rest);
        }
    }
});
