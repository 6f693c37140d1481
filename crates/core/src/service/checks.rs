//! What the service checks of a request before it touches the store or a VM.
//!
//! Separate because these are functions of the configuration and the
//! request only (no store, no VM, no await), public (re-exported from
//! [`crate::service`]) so that the fuzz targets (`fuzz/`) and the in-memory
//! fake of the API (`sandpit-fake`) run exactly these. Owns the checks of a
//! create, a command, a file write (and its size), an extension, a port, a
//! guest path and a page of a listing.

use crate::config::{ServiceConfig, SizeConfig};
use crate::error::{CoreError, Result};
use crate::model::*;
use base64::Engine;
use sandpit_protocol::ExecRequest;

// For the doc links: the checks are named after the calls they serve.
#[cfg(doc)]
use crate::api::SandboxApi;

/// What [`SandboxApi::create_sandbox`] checks of a request before anything
/// else: the size (its name and configuration) and the timeout it asks for.
pub fn check_create<'c>(
    config: &'c ServiceConfig,
    req: &CreateSandbox,
    idempotency_key: Option<&str>,
) -> Result<(String, &'c SizeConfig, u32)> {
    let size_name = req
        .size
        .clone()
        .unwrap_or_else(|| config.default_size.clone());
    let size = config.sizes.get(&size_name).ok_or_else(|| {
        CoreError::invalid(format!(
            "unknown size {size_name:?}; use one of: {}",
            config.sizes.keys().cloned().collect::<Vec<_>>().join(", ")
        ))
    })?;
    let timeout = req
        .timeout_minutes
        .unwrap_or(config.default_timeout_minutes);
    if timeout < 1 || timeout > config.max_timeout_minutes {
        return Err(CoreError::invalid(format!(
            "timeout_minutes must be between 1 and {}, not {timeout}",
            config.max_timeout_minutes
        )));
    }
    if let Some(n) = &req.name {
        if n.chars().count() > 200 {
            return Err(CoreError::invalid("name is at most 200 characters"));
        }
    }
    if let Some(k) = idempotency_key {
        if k.is_empty() || k.len() > 255 {
            return Err(CoreError::invalid(
                "Idempotency-Key must be 1 to 255 characters",
            ));
        }
    }
    Ok((size_name, size, timeout))
}

/// What [`SandboxApi::exec`] and [`SandboxApi::exec_stream`] check of a
/// command, and the agent request it becomes (defaults filled in).
pub fn validate_exec(config: &ServiceConfig, p: &ExecParams) -> Result<ExecRequest> {
    if p.command.trim().is_empty() {
        return Err(CoreError::invalid("command must not be empty"));
    }
    let timeout = p.timeout_ms.unwrap_or(config.exec_default_timeout_ms);
    if timeout < config.exec_min_timeout_ms || timeout > config.exec_max_timeout_ms {
        return Err(CoreError::invalid(format!(
            "timeout_ms must be between {} and {}, not {timeout}",
            config.exec_min_timeout_ms, config.exec_max_timeout_ms
        )));
    }
    const MAX_ARG: usize = crate::model::MAX_COMMAND_BYTES as usize;
    if p.command.len() > MAX_ARG {
        return Err(CoreError::invalid(format!(
            "command is {} bytes; a command can be at most {MAX_ARG} bytes (Linux's limit \
             on one argument): write a longer script with write_file and run that",
            p.command.len()
        )));
    }
    if p.cwd.as_ref().is_some_and(|c| c.len() > 4095) {
        return Err(CoreError::invalid("cwd is longer than 4095 bytes"));
    }
    let env = p.env.clone().unwrap_or_default();
    let mut env_bytes = 0usize;
    for (k, v) in &env {
        let len = k.len() + 1 + v.len();
        if len > MAX_ARG {
            return Err(CoreError::invalid(format!(
                "env {k} is {len} bytes; one variable can be at most {MAX_ARG} bytes"
            )));
        }
        env_bytes += len;
    }
    const MAX_ENV: usize = crate::model::MAX_ENV_BYTES as usize;
    if env_bytes > MAX_ENV {
        return Err(CoreError::invalid(format!(
            "env is {env_bytes} bytes in all; the limit is {MAX_ENV} bytes"
        )));
    }
    for k in env.keys() {
        let ok = !k.is_empty()
            && !k.as_bytes()[0].is_ascii_digit()
            && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !ok {
            return Err(CoreError::invalid(format!(
                "env name {k:?} is not a valid variable name (letters, digits, _)"
            )));
        }
    }
    Ok(ExecRequest {
        command: p.command.clone(),
        cwd: p.cwd.clone(),
        env,
        timeout_ms: timeout,
        // A command that keeps running is followed, not collected: all it
        // writes streams to its followers (the host bounds what it queues
        // for a slow one), and the host keeps `max_output_bytes` of it in
        // the execution's record (`Service::run_exec`). A terminal, or a
        // server's log, must not go quiet after its first megabyte.
        max_output_bytes: if p.keep_running {
            u64::MAX
        } else {
            config.max_output_bytes
        },
        keep_running: p.keep_running,
        stdin: p.stdin,
        pty: p.pty,
        // Every API's command runs as the guest user; root is a template
        // build's alone (`service::templates`).
        as_root: false,
    })
}

/// What [`SandboxApi::write_file`] checks of a request before it reaches a
/// sandbox: the path, and the content decoded and within the limit. Returns
/// the path as given and the bytes to write.
pub fn write_content(config: &ServiceConfig, req: WriteFile) -> Result<(String, Vec<u8>)> {
    let bytes = match req.encoding.unwrap_or_default() {
        Encoding::Utf8 => req.content.into_bytes(),
        Encoding::Base64 => base64::engine::general_purpose::STANDARD
            .decode(req.content.trim())
            .map_err(|e| CoreError::invalid(format!("content is not valid base64: {e}")))?,
    };
    check_write_size(config, bytes.len() as u64)?;
    check_path(&req.path)?;
    Ok((req.path, bytes))
}

/// A file of `size` bytes is within the write limit.
pub fn check_write_size(config: &ServiceConfig, size: u64) -> Result<()> {
    if size > config.max_write_bytes {
        return Err(CoreError::invalid(format!(
            "the file is {size} bytes; the limit is {} bytes",
            config.max_write_bytes
        )));
    }
    Ok(())
}

/// The minutes [`SandboxApi::extend_sandbox`] adds (checked before the
/// sandbox is looked up; the lifetime limit is checked against it after).
pub fn extension_minutes(config: &ServiceConfig, additional_minutes: Option<u32>) -> Result<u32> {
    let add = additional_minutes.unwrap_or(config.default_extend_minutes);
    if add < 1 {
        return Err(CoreError::invalid("additional_minutes must be at least 1"));
    }
    Ok(add)
}

/// A port [`SandboxApi::expose_port`] accepts.
pub fn check_port(port: u16) -> Result<()> {
    if port == 0 {
        return Err(CoreError::invalid("port must be between 1 and 65535"));
    }
    Ok(())
}

/// Paths are checked here only for what the guest cannot judge; permissions
/// are the guest user's own.
pub fn check_path(path: &str) -> Result<()> {
    sandpit_protocol::resolve_guest_path(path)
        .map(|_| ())
        .map_err(|e| CoreError::invalid(format!("bad path {path:?}: {}", e.message)))
}

/// A listing's page size when the request names none.
pub const DEFAULT_PAGE: u32 = 20;
/// The largest page a listing gives.
pub const MAX_PAGE: u32 = 100;

/// The page size of a listing (`limit`): 1 to [`MAX_PAGE`], [`DEFAULT_PAGE`]
/// unless given.
pub fn page_limit(limit: Option<u32>) -> Result<u32> {
    let limit = limit.unwrap_or(DEFAULT_PAGE);
    match (1..=MAX_PAGE).contains(&limit) {
        true => Ok(limit),
        false => Err(CoreError::invalid(format!(
            "limit must be between 1 and {MAX_PAGE}, not {limit}"
        ))),
    }
}

/// A listing's `starting_after` that names no `what` of the account's.
pub fn unknown_cursor(what: &str, cursor: &str) -> CoreError {
    CoreError::invalid(format!(
        "starting_after {cursor:?} is not a {what} of this account"
    ))
}
