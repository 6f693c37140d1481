//! Exposed ports and their preview URLs, as the service sees them.
//!
//! Separate because a preview URL is the one way in that no account
//! signs: anyone with the URL may ask, so every connection is checked
//! against the sandbox's row and its exposed ports here, bounded in time
//! and counted as the sandbox's traffic. Owns expose, list and close, the
//! preview check and admission, opening a preview connection wherever the
//! VM runs, and writing the traffic counters to the store. The connections
//! themselves (limits, counting, cutting) are [`crate::preview`]'s.

use crate::api::Caller;
use crate::api::Ports;
use crate::error::{CoreError, Result};
use crate::model::*;
use crate::preview::{preview_url, Admitted, PreviewConn, PreviewError, PreviewGate};
use crate::private_preview::{self, PreviewAccess};
use crate::service::checks::check_port;
use crate::service::Service;
use sandpit_host::ids::rfc3339;
use sandpit_protocol::ErrorKind;
use sandpit_runtime::RuntimeError;
use sandpit_store::{SandboxRow, StoreError};
use std::time::Duration;
use time::OffsetDateTime;

/// How long opening a preview connection may take, end to end.
const PREVIEW_CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

impl Service {
    /// Write preview traffic counters to the store (of one sandbox, or all).
    pub(super) async fn flush_traffic(&self, only: Option<&str>) {
        for (id, bytes_in, bytes_out) in self.previews.take_all() {
            if only.is_some_and(|o| o != id) {
                self.previews.restore(&id, bytes_in, bytes_out);
                continue;
            }
            match self
                .store
                .add_preview_traffic(&id, bytes_in, bytes_out)
                .await
            {
                Ok(_) => crate::metrics::record_preview_bytes(bytes_in, bytes_out),
                Err(e) => {
                    tracing::warn!(%id, "storing preview traffic: {e}");
                    self.previews.restore(&id, bytes_in, bytes_out);
                }
            }
        }
    }
}

#[async_trait::async_trait]
impl PreviewGate for Service {
    /// Can `port` of sandbox `id` be served through its preview URL now?
    /// Anyone with the URL may ask: no account is involved.
    /// Returns the node that holds the sandbox.
    async fn check_preview(&self, id: &str, port: u16) -> Result<Admitted, PreviewError> {
        // A visitor uses the sandbox as much as its owner does (and waits
        // for a pause for idleness under way, then resumes it).
        self.activity.touch(id);
        self.activity.unclaimed(id).await;
        if let Some(admitted) = self.previews.recently_checked(id, port) {
            return Ok(admitted);
        }
        let epoch = self.previews.check_epoch();
        let unavailable = |e: StoreError| PreviewError::Unavailable {
            id: id.to_string(),
            message: e.to_string(),
        };
        let mut row = self
            .store
            .sandbox(id)
            .await
            .map_err(unavailable)?
            .ok_or_else(|| PreviewError::NoSuchSandbox(id.to_string()))?;
        // Its visitors wait for a move as its owner's calls do.
        if row.is_moving(OffsetDateTime::now_utc()) {
            row = self
                .after_move(row)
                .await
                .map_err(|e| PreviewError::Unavailable {
                    id: id.to_string(),
                    message: e.message,
                })?;
        }
        // A paused sandbox resumes for its visitors as for its owner.
        if row.status == SandboxStatus::Paused {
            row = self
                .wake(&row, crate::service::events::PREVIEW)
                .await
                .map_err(|e| PreviewError::Unavailable {
                    id: id.to_string(),
                    message: e.message,
                })?;
        }
        // Gone from the moment it expires or its destroy starts, even while
        // the reaper or the destroy is still at work.
        let gone = |reason: &str| PreviewError::Gone {
            id: id.to_string(),
            reason: reason.to_string(),
        };
        if !row.is_live() {
            return Err(gone(
                row.deleted_reason.as_deref().unwrap_or(row.status.as_str()),
            ));
        }
        if row.expires_at <= OffsetDateTime::now_utc() {
            return Err(gone("expired"));
        }
        if row.status == SandboxStatus::Deleting {
            return Err(gone("destroyed"));
        }
        if row.status != SandboxStatus::Running {
            return Err(PreviewError::Unavailable {
                id: id.to_string(),
                message: format!("it is {}", row.status),
            });
        }
        let exposed = match row.every_port_public {
            true => Some(false),
            false => {
                let ports = self.store.list_ports(id).await.map_err(unavailable)?;
                ports.iter().find(|p| p.port == port).map(|p| p.private)
            }
        };
        let Some(private_port) = exposed else {
            return Err(PreviewError::PortClosed {
                id: id.to_string(),
                port,
            });
        };
        let access = match (private_port || row.private_traffic, &row.access_token) {
            (false, _) => PreviewAccess::Public,
            (true, Some(secret)) => PreviewAccess::Private {
                token: private_preview::traffic_token(secret),
                // E2B answers 403 for a sandbox made private whole.
                refusal: if row.private_traffic { 403 } else { 401 },
            },
            // Private, and no token to prove: nobody gets through.
            (true, None) => PreviewAccess::Private {
                token: hex::encode(rand::random::<[u8; 32]>()),
                refusal: 401,
            },
        };
        let admitted = Admitted {
            host: row.host.clone(),
            access,
        };
        self.previews
            .remember_check(id, port, row.expires_at, &admitted, epoch);
        Ok(admitted)
    }

    /// Take one request of the allowance of sandbox `id`'s preview URLs
    /// (after [`PreviewGate::check_preview`]: only live sandboxes have one).
    fn admit_preview_request(&self, id: &str) -> Result<(), PreviewError> {
        self.previews.admit_request(id)
    }

    /// Open a connection to `port` of sandbox `id` for its preview URL:
    /// checked as [`PreviewGate::check_preview`], bounded in time, counted as
    /// the sandbox's preview traffic, and cut when the port is closed or the
    /// sandbox ends.
    async fn open_preview(&self, id: &str, port: u16) -> Result<PreviewConn, PreviewError> {
        let host = self.check_preview(id, port).await?.host;
        let slot = self.previews.admit_connection(id).await?;
        let (sid, p) = (id.to_string(), port);
        let gate = self.previews.connect_gate(id, port);
        let open = async {
            let _permit = gate.acquire().await;
            let machines =
                self.machines_on(&host, id)
                    .await
                    .map_err(|e| PreviewError::Unavailable {
                        id: sid.clone(),
                        message: e.message,
                    })?;
            machines.open_tunnel(id, port).await.map_err(|e| match e {
                RuntimeError::Agent(a) if a.kind == ErrorKind::ConnectionRefused => {
                    PreviewError::NotListening {
                        id: sid.clone(),
                        port: p,
                    }
                }
                RuntimeError::Agent(a) if a.kind == ErrorKind::TimedOut => PreviewError::Timeout {
                    id: sid.clone(),
                    port: p,
                },
                other => PreviewError::Unavailable {
                    id: sid.clone(),
                    message: other.to_string(),
                },
            })
        };
        let tunnel = tokio::time::timeout(PREVIEW_CONNECT_TIMEOUT, open)
            .await
            .map_err(|_| PreviewError::Timeout {
                id: id.to_string(),
                port,
            })??;
        let conn = self.previews.register(id, port, tunnel, slot);
        // Closed or ended while connecting: cut it now rather than serve it.
        if let Err(e) = self.check_preview(id, port).await {
            self.previews.close(id, Some(port));
            return Err(e);
        }
        Ok(conn)
    }
}

#[async_trait::async_trait]
impl Ports for Service {
    /// The API's `expose_port`. A change of privacy cuts the port's open
    /// preview connections: the next ones are checked as it is now.
    async fn expose_port(
        &self,
        caller: &Caller,
        id: &str,
        port: u16,
        private: bool,
    ) -> Result<Port> {
        check_port(port)?;
        let (row, _busy) = self.running(caller, id).await?;
        if private && row.access_token.is_none() {
            return Err(CoreError::invalid(format!(
                "sandbox {id} was made before private ports: it has no traffic token"
            )));
        }
        let url = preview_url(
            &self.config.preview_scheme,
            &self.config.preview_domain,
            port,
            &row.id,
        );
        let p = self.store.upsert_port(&row.id, port, &url, private).await?;
        self.previews.close(&row.id, Some(port));
        Ok(port_of(&row, p))
    }

    /// The API's `list_ports`.
    async fn list_ports(&self, caller: &Caller, id: &str) -> Result<List<Port>> {
        let row = self.owned(caller, id).await?;
        let ports = self.store.list_ports(&row.id).await?;
        Ok(List::new(
            ports
                .into_iter()
                .filter(|p| p.closed_at.is_none())
                .map(|p| port_of(&row, p))
                .collect(),
            false,
            None,
        ))
    }

    /// The API's `sign_preview_url`.
    async fn sign_preview_url(
        &self,
        caller: &Caller,
        id: &str,
        port: u16,
        expires_in_seconds: Option<u64>,
    ) -> Result<SignedUrl> {
        let seconds = expires_in_seconds.unwrap_or(private_preview::DEFAULT_SIGNED_SECONDS);
        if !(1..=private_preview::MAX_SIGNED_SECONDS).contains(&seconds) {
            return Err(CoreError::invalid(format!(
                "expires_in_seconds must be 1..{}; it was {seconds}",
                private_preview::MAX_SIGNED_SECONDS
            )));
        }
        let row = self.owned(caller, id).await?;
        let exposed = self.store.list_ports(&row.id).await?;
        let private = exposed.iter().any(|p| p.port == port && p.private) || row.private_traffic;
        if !row.is_live() || !private {
            return Err(CoreError::not_found("private port", &port.to_string()));
        }
        let url = preview_url(
            &self.config.preview_scheme,
            &self.config.preview_domain,
            port,
            &row.id,
        );
        signed(&row, &url, port, seconds)
            .ok_or_else(|| CoreError::not_found("private port", &port.to_string()))
    }

    /// The API's `close_port`.
    async fn close_port(&self, caller: &Caller, id: &str, port: u16) -> Result<()> {
        let row = self.owned(caller, id).await?;
        if self.store.close_port(&row.id, port).await? {
            self.previews.close(&row.id, Some(port));
            Ok(())
        } else {
            Err(CoreError::not_found("exposed port", &port.to_string()))
        }
    }
}

/// Port row `p` of sandbox `row` as the API shows it: a private one with a
/// URL signed for an hour.
fn port_of(row: &SandboxRow, p: sandpit_store::PortRow) -> Port {
    let signed = p
        .private
        .then(|| signed(row, &p.url, p.port, private_preview::DEFAULT_SIGNED_SECONDS))
        .flatten();
    Port {
        port: p.port,
        created_at: rfc3339(p.created_at),
        private: p.private,
        signed_url: signed.as_ref().map(|s| s.url.clone()),
        signed_url_expires_at: signed.map(|s| s.expires_at),
        url: p.url,
    }
}

/// `url` (port `port` of sandbox `row`) signed for `seconds` from now.
fn signed(row: &SandboxRow, url: &str, port: u16, seconds: u64) -> Option<SignedUrl> {
    let token = private_preview::traffic_token(row.access_token.as_deref()?);
    let expires = OffsetDateTime::now_utc() + time::Duration::seconds(seconds as i64);
    let expires_unix = expires.unix_timestamp() as u64;
    Some(SignedUrl {
        url: private_preview::signed_url(url, &token, &row.id, port, expires_unix),
        expires_at: rfc3339(expires.replace_nanosecond(0).unwrap_or(expires)),
    })
}
