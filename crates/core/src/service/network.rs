//! A sandbox's own egress: what its create asked for (E2B's
//! `allow_internet_access`, its own `allow_out` and `deny_out` lists, the
//! secrets its egress proxy brokers and its network rules), stored with it, given to every start
//! of its VM ([`Service::egress`]), and replaced while it lives
//! (`update_network`).
//!
//! Separate because every way a VM starts (create, restore, resume, fork,
//! wake from idle sleep) asks it what the sandbox may reach, and the one
//! change a live sandbox's network has goes through the same checks as its
//! create.

use crate::api::Caller;
use crate::error::{CoreError, Result};
use crate::model::*;
use crate::service::errors::{not_running, runtime_error};
use crate::service::Service;
use sandpit_runtime::Egress;
use sandpit_store::SandboxRow;

/// What sandbox `row`'s guest may reach: nothing when its create said no
/// internet, else its own lists (checked when they were stored; a row that
/// cannot be read gets nothing rather than everything).
fn egress_of(row: &SandboxRow) -> Egress {
    if row.internet_access == Some(false) {
        return Egress::blocked();
    }
    match row.network.as_deref().map(lists_of) {
        None => Egress::open(),
        Some(Ok(lists)) => lists,
        Some(Err(e)) => {
            tracing::warn!(sandbox = %row.id, "its stored egress lists: {e}; it gets none");
            Egress::blocked()
        }
    }
}

/// Stored lists (`sandboxes.network`) as the runtime's egress.
fn lists_of(json: &str) -> std::result::Result<Egress, String> {
    let lists: NetworkLists = serde_json::from_str(json).map_err(|e| e.to_string())?;
    Egress::checked(lists.allow_out, lists.deny_out)
}

/// A create's lists checked, as stored (`None`: none).
pub(crate) fn stored_lists(lists: Option<&NetworkLists>) -> Result<Option<String>> {
    let Some(lists) = lists.filter(|l| !l.allow_out.is_empty() || !l.deny_out.is_empty()) else {
        return Ok(None);
    };
    for (name, list) in [
        ("allow_out", &lists.allow_out),
        ("deny_out", &lists.deny_out),
    ] {
        if list.len() > MAX_EGRESS_ENTRIES {
            return Err(CoreError::invalid(format!(
                "{name} has {} entries; at most {MAX_EGRESS_ENTRIES}",
                list.len()
            )));
        }
    }
    Egress::checked(lists.allow_out.clone(), lists.deny_out.clone()).map_err(|e| {
        CoreError::invalid(format!(
            "network: {e} (an entry is an IPv4 address or prefix, or a host name such as \
             example.com or *.example.com)"
        ))
    })?;
    Ok(Some(serde_json::to_string(lists).expect("json")))
}

/// The most entries one egress list may have.
const MAX_EGRESS_ENTRIES: usize = 256;

impl Service {
    /// The egress every start of sandbox `row`'s VM is given (and a live
    /// one when it changes): what its guest may reach, and the secrets its
    /// egress proxy brokers, with their values (see `secrets`). Secrets
    /// that cannot be read or unsealed are left out, logged: the VM starts
    /// without them rather than not at all.
    pub(crate) async fn egress(&self, row: &SandboxRow) -> Egress {
        self.egress_with(row, None).await
    }

    /// [`Service::egress`] with network rules `rules` (JSON, as stored)
    /// instead of its stored ones, when given.
    async fn egress_with(&self, row: &SandboxRow, rules: Option<Option<&str>>) -> Egress {
        let lists = egress_of(row);
        let Some(broker) = self.broker_of(row, rules).await else {
            return lists;
        };
        match lists.clone().with_broker(broker) {
            Ok(egress) => egress,
            Err(why) => {
                tracing::warn!(sandbox = %row.id, "its secrets: {why}; it gets none");
                lists
            }
        }
    }

    /// The API's `update_network`: sandbox `id`'s egress replaced by
    /// `lists` (and, from E2B's update, whether it may reach the network at
    /// all, and its network `rules`; `None`: they stay). A running
    /// sandbox's VM gets it first (in effect when this answers), then the
    /// store; a paused one (or one asleep) has it stored and gets it when
    /// it resumes. In its turn with pause and resume, so neither starts a
    /// VM with the egress it had before. A sandbox given rules gets a CA of
    /// its own first if it has none (its guest trusts it from this egress
    /// on).
    pub(super) async fn replace_network(
        &self,
        caller: &Caller,
        id: &str,
        lists: NetworkLists,
        internet_access: Option<bool>,
        rules: Option<NetworkRules>,
    ) -> Result<Sandbox> {
        let network = stored_lists(Some(&lists))?;
        let rules = match &rules {
            Some(rules) => Some(self.stored_rules(caller, rules).await?),
            None => None,
        };
        self.owned(caller, id).await?;
        let _turn = self.turns.take(id).await;
        let row = self.owned(caller, id).await?;
        let mut changed = row.clone();
        changed.internet_access = internet_access;
        changed.network = network.clone();
        let machines = match row.status {
            SandboxStatus::Running => Some(self.machines_for(&row).await?),
            SandboxStatus::Paused => None,
            SandboxStatus::Provisioning => {
                return Err(CoreError::conflict(format!(
                    "sandbox {id} is still starting; change its network once it runs"
                )))
            }
            _ => return Err(not_running(&row)),
        };
        if let Some(Some(_)) = &rules {
            self.ensure_broker(&row).await?;
        }
        let new_rules = rules.as_ref().map(|r| r.as_deref());
        if let Some(m) = &machines {
            m.set_egress(id, self.egress_with(&changed, new_rules).await)
                .await
                .map_err(runtime_error)?;
        }
        let mut stored = self
            .store
            .set_sandbox_network(id, internet_access, network.as_deref())
            .await;
        if let (Ok(true), Some(rules)) = (&stored, new_rules) {
            stored = self.store.set_sandbox_rules(id, rules).await;
        }
        if !matches!(stored, Ok(true)) {
            // Not stored: the VM goes back to what the sandbox has.
            if let Some(m) = &machines {
                let _ = m.set_egress(id, self.egress(&row).await).await;
            }
        }
        if !stored? {
            return Err(not_running(&self.owned(caller, id).await?));
        }
        Ok(super::lifecycle::to_sandbox(&changed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lists(allow: &[&str], deny: &[&str]) -> NetworkLists {
        NetworkLists {
            allow_out: allow.iter().map(|s| s.to_string()).collect(),
            deny_out: deny.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn lists_are_checked_and_stored_as_json_or_not_at_all() {
        assert_eq!(stored_lists(None).unwrap(), None);
        assert_eq!(stored_lists(Some(&lists(&[], &[]))).unwrap(), None);
        let stored = stored_lists(Some(&lists(&["198.51.100.7"], &["0.0.0.0/0"])))
            .unwrap()
            .unwrap();
        assert_eq!(
            lists_of(&stored).unwrap(),
            Egress::checked(vec!["198.51.100.7".into()], vec!["0.0.0.0/0".into()]).unwrap()
        );
        assert!(stored_lists(Some(&lists(&["example.com", "*.pypi.org"], &["0.0.0.0/0"]))).is_ok());
        let bad = stored_lists(Some(&lists(&["exa mple.com"], &[]))).unwrap_err();
        assert!(
            bad.message.contains("is not a host name"),
            "{}",
            bad.message
        );
        let bad = stored_lists(Some(&lists(&["10.0.0.1/8"], &[]))).unwrap_err();
        assert!(
            bad.message.contains("bits set past its prefix"),
            "{}",
            bad.message
        );
        let many: Vec<String> = (0..=256)
            .map(|i| format!("10.0.{}.{}", i / 256, i % 256))
            .collect();
        let too_many = NetworkLists {
            allow_out: vec![],
            deny_out: many,
        };
        assert!(stored_lists(Some(&too_many))
            .unwrap_err()
            .message
            .contains("at most 256"));
    }
}
