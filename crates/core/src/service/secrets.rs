//! Secrets that never enter the VM (`Secrets`): an account's credentials,
//! stored sealed (see [`crate::secrets_key`]), and what a sandbox created
//! with some of them has instead: a placeholder in an environment variable
//! of each of its commands, its own CA, and a broker its host's egress
//! proxy is given at every start of its VM, which puts the value in place
//! of the placeholder in HTTPS requests to the secret's hosts only (see
//! `sandpit_runtime::egress::broker`).
//!
//! E2B's secrets are the same secrets, one namespace per account: made
//! with E2B's names (lower-cased, `-` allowed) and no hosts, found by id
//! (`sec_…`) or name, given new values (a version each) and metadata. A
//! secret without hosts is put in requests by network rules only (E2B's
//! `network.rules`: per host, headers whose templates name secrets,
//! `Bearer ${e2b.secrets.NAME}`): a create's `secrets` cannot name it (its
//! placeholder would go nowhere), and the REST API lists it with no hosts.
//! A sandbox's rules are stored as written, resolved here at every start
//! of its VM and every change, into header rules of its broker (which then
//! has a CA of its own whatever its secrets).
//!
//! Separate because a secret's checks, its sealing, the broker a sandbox's
//! VM gets (read, unsealed, left out when it cannot be), and the egress
//! sent again when a secret changes or this process restarts (the runtime
//! keeps no value on disk) are one concern, which create, fork and every
//! start of a VM ask of it.

use crate::api::{Caller, Secrets};
use crate::error::{CoreError, ErrorType, Result};
use crate::model::*;
use crate::secrets_key::{broker_ca_place, secret_place};
use crate::service::Service;
use async_trait::async_trait;
use sandpit_host::ids::rfc3339;
use sandpit_runtime::egress::names::NameRule;
use sandpit_runtime::{Broker, BrokerCa, BrokeredSecret, HeaderRule, Sensitive};
use sandpit_store::{NewSecret, SandboxBroker, SandboxRow, SecretRow, SecretValue};
use std::collections::BTreeMap;
use time::OffsetDateTime;

/// The longest secret name (an environment variable's).
const MAX_NAME_BYTES: usize = 64;
/// The largest value.
const MAX_VALUE_BYTES: usize = 8 * 1024;
/// The most hosts one secret may be sent to.
const MAX_HOSTS: usize = 32;
/// The longest format.
const MAX_FORMAT_BYTES: usize = 1024;
/// The most secrets one sandbox uses.
pub const MAX_SANDBOX_SECRETS: usize = 32;
/// The header a secret goes in unless its put says.
const DEFAULT_HEADER: &str = "Authorization";
/// The header's value unless its put says.
const DEFAULT_FORMAT: &str = "Bearer {value}";
/// What a placeholder starts with (then 40 random lower-case hex digits).
const PLACEHOLDER_PREFIX: &str = "sandpit-secret-";

/// The longest E2B name.
const MAX_E2B_NAME_BYTES: usize = 128;
/// What starts a secret's id, and so no E2B name.
const ID_PREFIX: &str = "sec_";
/// The most metadata entries a secret has, the longest key and value, and
/// the most bytes of them all (E2B's).
const MAX_METADATA_ENTRIES: usize = 32;
const MAX_METADATA_KEY_BYTES: usize = 128;
const MAX_METADATA_VALUE_BYTES: usize = 1024;
const MAX_METADATA_BYTES: usize = 8192;
/// The most hosts a sandbox's network rules name, and headers per host.
const MAX_RULE_HOSTS: usize = 32;
const MAX_RULE_HEADERS: usize = 32;
/// The longest header value a rule's template may be.
const MAX_TEMPLATE_BYTES: usize = 8 * 1024;
/// What a reference to a secret in a rule's template starts with.
const SECRET_REFERENCE: &str = "${e2b.secrets.";

/// An E2B name checked, in its canonical (lower-case) form: letters,
/// digits, `-` and `_`, at most 128 bytes, not starting `sec_` (an id's).
fn check_e2b_name(name: &str) -> Result<String> {
    let name = name.to_ascii_lowercase();
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(CoreError::invalid(format!(
            "secret name {name:?} is not usable: letters, digits, - and _ only"
        )));
    }
    if name.len() > MAX_E2B_NAME_BYTES {
        return Err(CoreError::invalid(format!(
            "secret name {name:?} is {} bytes; at most {MAX_E2B_NAME_BYTES}",
            name.len()
        )));
    }
    if name.starts_with(ID_PREFIX) {
        return Err(CoreError::invalid(format!(
            "secret name {name:?}: the {ID_PREFIX} prefix is reserved for secret ids"
        )));
    }
    Ok(name)
}

/// A secret's value checked: it goes in a request header.
fn check_value(value: &str) -> Result<()> {
    if value.is_empty() {
        return Err(CoreError::invalid("a secret's value must not be empty"));
    }
    if value.len() > MAX_VALUE_BYTES {
        return Err(CoreError::invalid(format!(
            "a secret's value is at most {MAX_VALUE_BYTES} bytes, not {}",
            value.len()
        )));
    }
    if value.contains(['\r', '\n', '\0']) {
        return Err(CoreError::invalid(
            "a secret's value goes in a request header: it cannot hold CR, LF or NUL",
        ));
    }
    Ok(())
}

/// Metadata checked (E2B's limits), as stored (JSON).
fn check_metadata(metadata: &BTreeMap<String, String>) -> Result<String> {
    if metadata.len() > MAX_METADATA_ENTRIES {
        return Err(CoreError::invalid(format!(
            "metadata has {} entries; at most {MAX_METADATA_ENTRIES}",
            metadata.len()
        )));
    }
    for (k, v) in metadata {
        if k.len() > MAX_METADATA_KEY_BYTES {
            return Err(CoreError::invalid(format!(
                "metadata key {k:?} is {} bytes; at most {MAX_METADATA_KEY_BYTES}",
                k.len()
            )));
        }
        if v.len() > MAX_METADATA_VALUE_BYTES {
            return Err(CoreError::invalid(format!(
                "metadata {k:?}'s value is {} bytes; at most {MAX_METADATA_VALUE_BYTES}",
                v.len()
            )));
        }
    }
    let total: usize = metadata.iter().map(|(k, v)| k.len() + v.len()).sum();
    if total > MAX_METADATA_BYTES {
        return Err(CoreError::invalid(format!(
            "metadata holds {total} bytes; at most {MAX_METADATA_BYTES} in all"
        )));
    }
    Ok(serde_json::to_string(metadata).expect("strings serialize"))
}

/// A rule's template in pieces: literal text and the names of the
/// secrets it refers to (`${e2b.secrets.NAME}`), in order. Another
/// `${e2b.…}` reference is refused: nothing here resolves it.
#[derive(Debug, PartialEq, Eq)]
enum Piece<'t> {
    Text(&'t str),
    Secret(&'t str),
}

fn parse_template(template: &str) -> std::result::Result<Vec<Piece<'_>>, String> {
    let mut pieces = Vec::new();
    let mut rest = template;
    while let Some(at) = rest.find("${e2b.") {
        if at > 0 {
            pieces.push(Piece::Text(&rest[..at]));
        }
        let Some(end) = rest[at..].find('}') else {
            return Err(format!(
                "{template:?}: a ${{e2b.…}} reference that does not end"
            ));
        };
        let reference = &rest[at..at + end + 1];
        let Some(name) = reference
            .strip_prefix(SECRET_REFERENCE)
            .and_then(|r| r.strip_suffix('}'))
            .filter(|n| !n.is_empty())
        else {
            return Err(format!(
                "{reference}: only ${{e2b.secrets.NAME}} is resolved here (workload identity                  tokens are not supported)"
            ));
        };
        pieces.push(Piece::Secret(name));
        rest = &rest[at + end + 1..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest));
    }
    Ok(pieces)
}

/// Among `rows`, the secret a reference names: that name, else its
/// lower-case form (E2B's canonical one).
fn named<'r, T>(rows: &'r [(SecretRow, T)], name: &str) -> Option<&'r (SecretRow, T)> {
    rows.iter().find(|(s, _)| s.name == name).or_else(|| {
        let lower = name.to_ascii_lowercase();
        rows.iter().find(|(s, _)| s.name == lower)
    })
}

/// `template` with each secret it names replaced by its value (`value`
/// finds it): the header's value and the names used, or the name of a
/// secret that cannot be found.
fn resolve_template(
    template: &str,
    value: impl Fn(&str) -> Option<String>,
) -> std::result::Result<(String, Vec<String>), String> {
    let mut out = String::new();
    let mut used = Vec::new();
    for piece in parse_template(template)? {
        match piece {
            Piece::Text(t) => out.push_str(t),
            Piece::Secret(name) => {
                out.push_str(&value(name).ok_or_else(|| name.to_string())?);
                if !used.iter().any(|u| u == name) {
                    used.push(name.to_string());
                }
            }
        }
    }
    Ok((out, used))
}

/// Network rules checked, their secrets' names collected (each once): why
/// not, in the message.
fn check_rules(rules: &NetworkRules) -> Result<Vec<String>> {
    if rules.len() > MAX_RULE_HOSTS {
        return Err(CoreError::invalid(format!(
            "network rules name {} hosts; at most {MAX_RULE_HOSTS}",
            rules.len()
        )));
    }
    let mut names: Vec<String> = Vec::new();
    for (host, headers) in rules {
        NameRule::parse(host).map_err(|e| {
            CoreError::invalid(format!(
                "network rules: {e} (a rule's key is a host name such as api.example.com or                  *.example.com)"
            ))
        })?;
        if headers.len() > MAX_RULE_HEADERS {
            return Err(CoreError::invalid(format!(
                "network rules for {host} set {} headers; at most {MAX_RULE_HEADERS}",
                headers.len()
            )));
        }
        for (header, template) in headers {
            if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
                return Err(CoreError::invalid(format!(
                    "network rules for {host}: {header:?} is not an HTTP header name"
                )));
            }
            if template.is_empty()
                || template.len() > MAX_TEMPLATE_BYTES
                || template.contains(['\r', '\n', '\0'])
            {
                return Err(CoreError::invalid(format!(
                    "network rules for {host}: header {header}'s value must be 1 to                      {MAX_TEMPLATE_BYTES} bytes, without CR, LF or NUL"
                )));
            }
            let pieces = parse_template(template)
                .map_err(|e| CoreError::invalid(format!("network rules for {host}: {e}")))?;
            for piece in pieces {
                if let Piece::Secret(name) = piece {
                    if !names.iter().any(|n| n == name) {
                        names.push(name.to_string());
                    }
                }
            }
        }
    }
    Ok(names)
}

/// Whether `name` is a secret's name: an environment variable's
/// (`[A-Za-z_][A-Za-z0-9_]*`), at most 64 bytes.
fn check_name(name: &str) -> Result<()> {
    let well_formed = !name.is_empty()
        && !name.as_bytes()[0].is_ascii_digit()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !well_formed {
        return Err(CoreError::invalid(format!(
            "secret name {name:?} is not an environment variable's name (letters, digits and _, \
             not starting with a digit)"
        )));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(CoreError::invalid(format!(
            "secret name {name:?} is {} bytes; at most {MAX_NAME_BYTES}",
            name.len()
        )));
    }
    Ok(())
}

/// A put checked: the secret as stored, its value not sealed yet.
#[derive(Debug)]
struct Checked {
    hosts: Vec<String>,
    header: String,
    format: String,
}

/// What a put of secret `name` must be: why not, in the message.
fn check_put(name: &str, req: &PutSecret) -> Result<Checked> {
    check_name(name)?;
    check_value(&req.value)?;
    if !(1..=MAX_HOSTS).contains(&req.hosts.len()) {
        return Err(CoreError::invalid(format!(
            "hosts names 1 to {MAX_HOSTS} hosts the secret may be sent to, not {}",
            req.hosts.len()
        )));
    }
    for host in &req.hosts {
        NameRule::parse(host).map_err(|e| {
            CoreError::invalid(format!(
                "hosts: {e} (a host is a name such as api.example.com, or *.example.com for \
                 any name under it)"
            ))
        })?;
    }
    let header = req.header.as_deref().unwrap_or(DEFAULT_HEADER);
    if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
        return Err(CoreError::invalid(format!(
            "header {header:?} is not an HTTP header name"
        )));
    }
    let format = req.format.as_deref().unwrap_or(DEFAULT_FORMAT);
    if format.matches("{value}").count() != 1 {
        return Err(CoreError::invalid(format!(
            "format {format:?} must hold {{value}} exactly once, where the secret goes \
             (`Bearer {{value}}`, or `{{value}}` alone)"
        )));
    }
    if format.len() > MAX_FORMAT_BYTES || format.contains(['\r', '\n', '\0']) {
        return Err(CoreError::invalid(format!(
            "format is a header's value: at most {MAX_FORMAT_BYTES} bytes, without CR, LF or NUL"
        )));
    }
    Ok(Checked {
        hosts: req.hosts.iter().map(|h| h.trim().to_string()).collect(),
        header: header.to_string(),
        format: format.to_string(),
    })
}

/// A secret as the API shows it: never its value.
fn to_secret(row: &SecretRow) -> Secret {
    Secret {
        object: "secret".into(),
        name: row.name.clone(),
        hosts: row.hosts.clone(),
        header: row.header.clone(),
        format: row.format.clone(),
        created_at: rfc3339(row.created_at),
        updated_at: rfc3339(row.updated_at),
        last_used_at: row.last_used_at.map(rfc3339),
        id: row.id.clone(),
        version: row.version,
        metadata: serde_json::from_str(&row.metadata).unwrap_or_default(),
    }
}

/// A new placeholder: what the guest has instead of a value, fresh for
/// each sandbox and secret.
fn new_placeholder() -> String {
    format!(
        "{PLACEHOLDER_PREFIX}{}",
        hex::encode(rand::random::<[u8; 20]>())
    )
}

/// The account has no secret `name`.
fn no_secret(name: &str) -> CoreError {
    CoreError::new(ErrorType::NotFound, format!("no secret named {name:?}"))
}

#[async_trait]
impl Secrets for Service {
    async fn put_secret(&self, caller: &Caller, name: &str, req: PutSecret) -> Result<Secret> {
        let checked = check_put(name, &req)?;
        let sealed_value = self.config.secrets_key.seal(
            req.value.as_bytes(),
            &secret_place(&caller.account_id, name),
        );
        let row = self
            .store
            .put_secret(&NewSecret {
                account_id: caller.account_id.clone(),
                name: name.to_string(),
                hosts: checked.hosts,
                header: checked.header,
                format: checked.format,
                sealed_value,
            })
            .await?;
        self.resend_egress_using(caller, name).await;
        Ok(to_secret(&row))
    }

    async fn list_secrets(&self, caller: &Caller) -> Result<List<Secret>> {
        self.note_secrets_used(&caller.account_id).await;
        let rows = self.store.list_secrets(&caller.account_id).await?;
        Ok(List::new(rows.iter().map(to_secret).collect(), false, None))
    }

    async fn delete_secret(&self, caller: &Caller, name: &str) -> Result<Secret> {
        let name = match self.find_secret(caller, name).await {
            Ok(found) => found.name,
            Err(_) => name.to_string(),
        };
        let Some(row) = self.store.delete_secret(&caller.account_id, &name).await? else {
            return Err(no_secret(&name));
        };
        self.resend_egress_using(caller, &name).await;
        Ok(to_secret(&row))
    }

    async fn create_secret(
        &self,
        caller: &Caller,
        name: &str,
        value: String,
        metadata: BTreeMap<String, String>,
    ) -> Result<Secret> {
        let name = check_e2b_name(name)?;
        check_value(&value)?;
        let metadata = check_metadata(&metadata)?;
        let sealed_value = self
            .config
            .secrets_key
            .seal(value.as_bytes(), &secret_place(&caller.account_id, &name));
        let secret = NewSecret {
            account_id: caller.account_id.clone(),
            name: name.clone(),
            hosts: Vec::new(),
            header: DEFAULT_HEADER.into(),
            format: DEFAULT_FORMAT.into(),
            sealed_value,
        };
        let Some(row) = self.store.create_secret(&secret, &metadata).await? else {
            return Err(CoreError::conflict(format!(
                "the account has a secret named {name:?} already"
            )));
        };
        self.resend_egress_using(caller, &name).await;
        Ok(to_secret(&row))
    }

    async fn get_secret(&self, caller: &Caller, secret: &str) -> Result<Secret> {
        self.note_secrets_used(&caller.account_id).await;
        Ok(to_secret(&self.find_secret(caller, secret).await?))
    }

    async fn update_secret(
        &self,
        caller: &Caller,
        secret: &str,
        value: String,
        metadata: Option<BTreeMap<String, String>>,
    ) -> Result<Secret> {
        check_value(&value)?;
        let metadata = metadata.as_ref().map(check_metadata).transpose()?;
        let found = self.find_secret(caller, secret).await?;
        let sealed_value = self.config.secrets_key.seal(
            value.as_bytes(),
            &secret_place(&caller.account_id, &found.name),
        );
        let change = SecretValue {
            sealed_value,
            metadata,
        };
        let Some(row) = self
            .store
            .update_secret_value(&caller.account_id, &found.name, &change)
            .await?
        else {
            return Err(no_secret(secret));
        };
        self.resend_egress_using(caller, &row.name).await;
        Ok(to_secret(&row))
    }
}

impl Service {
    /// Writes when the account's running sandboxes last put each secret
    /// into a request: their egress proxies keep it in memory only, so it
    /// is read from them when secrets are listed or read, and from a VM
    /// about to pause or end ([`Service::note_secrets_used_by`]).
    async fn note_secrets_used(&self, account_id: &str) {
        let ids = match self.store.running_brokered_sandboxes(account_id).await {
            Ok(ids) => ids,
            Err(e) => return tracing::warn!("finding the sandboxes with secrets: {e}"),
        };
        for id in ids {
            if let Ok(Some(row)) = self.store.sandbox(&id).await {
                self.note_secrets_used_by(&row).await;
            }
        }
    }

    /// Writes when sandbox `row`'s VM last put each of its secrets into a
    /// request (nothing for a sandbox without secrets).
    pub(crate) async fn note_secrets_used_by(&self, row: &SandboxRow) {
        match self.store.sandbox_broker(&row.id).await {
            Ok(Some(_)) => {}
            Ok(None) => return,
            Err(e) => return tracing::warn!(sandbox = %row.id, "reading its broker: {e}"),
        }
        let used = match self.machines_for(row).await {
            Ok(machines) => machines
                .secrets_used(&row.id)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.message),
        };
        let used = match used {
            Ok(used) => used,
            Err(e) => return tracing::debug!(sandbox = %row.id, "reading its secrets' use: {e}"),
        };
        let rfc3339 = &time::format_description::well_known::Rfc3339;
        for (name, at) in used {
            let Ok(at) = OffsetDateTime::parse(&at, rfc3339) else {
                continue;
            };
            if let Err(e) = self
                .store
                .note_secret_used(&row.account_id, &name, at)
                .await
            {
                tracing::warn!(sandbox = %row.id, secret = %name, "noting its use: {e}");
            }
        }
    }

    /// The account's secret of id `secret`, or of that name (as it is,
    /// else lower-cased).
    async fn find_secret(&self, caller: &Caller, secret: &str) -> Result<SecretRow> {
        let account = &caller.account_id;
        if secret.starts_with(ID_PREFIX) {
            if let Some(row) = self.store.secret_by_id(account, secret).await? {
                return Ok(row);
            }
        }
        if let Some(row) = self.store.secret(account, secret).await? {
            return Ok(row);
        }
        let lower = secret.to_ascii_lowercase();
        if lower != secret {
            if let Some(row) = self.store.secret(account, &lower).await? {
                return Ok(row);
            }
        }
        Err(no_secret(secret))
    }

    /// Network rules checked, each secret they name the account's: as
    /// stored (JSON; `None` for none).
    pub(super) async fn stored_rules(
        &self,
        caller: &Caller,
        rules: &NetworkRules,
    ) -> Result<Option<String>> {
        let names = check_rules(rules)?;
        if rules.is_empty() {
            return Ok(None);
        }
        let mut asked = names.clone();
        asked.extend(names.iter().map(|n| n.to_ascii_lowercase()));
        asked.sort();
        asked.dedup();
        let found = self.store.secrets_named(&caller.account_id, &asked).await?;
        if let Some(missing) = names.iter().find(|n| named(&found, n).is_none()) {
            return Err(CoreError::invalid(format!(
                "network rules: the account has no secret named {missing:?} (create it first)"
            )));
        }
        Ok(Some(
            serde_json::to_string(rules).expect("strings serialize"),
        ))
    }

    /// Sandbox `row`'s network rules (`stored`, JSON) resolved: a header
    /// rule for each host and header, its secrets unsealed. A header whose
    /// secret is gone, or does not open, is left out (logged).
    async fn header_rules(&self, row: &SandboxRow, stored: &str) -> Vec<HeaderRule> {
        let rules: NetworkRules = match serde_json::from_str(stored) {
            Ok(rules) => rules,
            Err(e) => {
                tracing::warn!(sandbox = %row.id, "its network rules: {e}; it gets none");
                return Vec::new();
            }
        };
        let names = check_rules(&rules).unwrap_or_default();
        let mut asked = names.clone();
        asked.extend(names.iter().map(|n| n.to_ascii_lowercase()));
        asked.sort();
        asked.dedup();
        let found = match self.store.secrets_named(&row.account_id, &asked).await {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(sandbox = %row.id, "reading its rules' secrets: {e}; it gets none");
                return Vec::new();
            }
        };
        let key = &self.config.secrets_key;
        let value = |name: &str| {
            let (secret, sealed) = named(&found, name)?;
            let opened = key
                .open(sealed, &secret_place(&row.account_id, &secret.name))
                .map_err(|why| tracing::warn!(sandbox = %row.id, secret = %name, "{why}"))
                .ok()?;
            String::from_utf8(opened).ok()
        };
        let mut headers = Vec::new();
        for (host, set) in &rules {
            for (header, template) in set {
                match resolve_template(template, value) {
                    Ok((resolved, secrets)) => headers.push(HeaderRule {
                        hosts: vec![host.clone()],
                        header: header.clone(),
                        value: Sensitive::new(resolved),
                        secrets,
                    }),
                    Err(missing) => tracing::warn!(
                        sandbox = %row.id, %host, %header,
                        "its secret {missing:?} is gone or does not open; the header is not set"
                    ),
                }
            }
        }
        headers
    }

    /// The placeholders a create's `secrets` get, `(name, placeholder)`:
    /// each must name a secret of the account, once, and no variable of
    /// the create's own `env`.
    pub(super) async fn placeholders_for(
        &self,
        caller: &Caller,
        req: &CreateSandbox,
    ) -> Result<Vec<(String, String)>> {
        if req.secrets.is_empty() {
            return Ok(Vec::new());
        }
        if req.secrets.len() > MAX_SANDBOX_SECRETS {
            return Err(CoreError::invalid(format!(
                "secrets names {} secrets; a sandbox uses at most {MAX_SANDBOX_SECRETS}",
                req.secrets.len()
            )));
        }
        for (i, name) in req.secrets.iter().enumerate() {
            check_name(name)?;
            if req.secrets[..i].contains(name) {
                return Err(CoreError::invalid(format!("secrets names {name:?} twice")));
            }
            if req.env.contains_key(name) {
                return Err(CoreError::invalid(format!(
                    "{name} is both a secret and a variable of env: give it once"
                )));
            }
        }
        let found = self
            .store
            .secrets_named(&caller.account_id, &req.secrets)
            .await?;
        if let Some(missing) = req
            .secrets
            .iter()
            .find(|name| !found.iter().any(|(row, _)| row.name == **name))
        {
            return Err(CoreError::invalid(format!(
                "secrets: the account has no secret named {missing:?} (store it with \
                 PUT /v1/secrets/{missing} first)"
            )));
        }
        if let Some((hostless, _)) = found.iter().find(|(row, _)| row.hosts.is_empty()) {
            return Err(CoreError::invalid(format!(
                "secrets: secret {:?} names no host to send it to (it was made through E2B's \
                 API: network rules use it; give it hosts with PUT /v1/secrets/{} to name it \
                 here)",
                hostless.name, hostless.name
            )));
        }
        Ok(req
            .secrets
            .iter()
            .map(|name| (name.clone(), new_placeholder()))
            .collect())
    }

    /// New sandbox `row`'s broker, before its VM starts: a CA of its own,
    /// `placeholders` (see [`Service::placeholders_for`]) and `rules` (see
    /// [`Service::stored_rules`]), or a fork's origin's (`secrets_of`: its
    /// guest trusts that CA and holds those placeholders already; its rules
    /// go with them). A sandbox whose broker cannot be stored ends failed,
    /// its reservation given back, rather than start without it.
    pub(super) async fn give_broker(
        &self,
        row: &SandboxRow,
        placeholders: &[(String, String)],
        rules: Option<&str>,
        secrets_of: Option<&str>,
    ) -> Result<()> {
        let made = match (placeholders.is_empty() && rules.is_none(), secrets_of) {
            (false, _) => self.new_broker(&row.id, placeholders, rules).map(Some),
            (true, Some(origin)) => self.origin_broker(origin, &row.id).await,
            (true, None) => return Ok(()),
        };
        let stored = match made {
            Ok(Some(broker)) => self
                .store
                .set_sandbox_broker(&row.id, &broker)
                .await
                .map_err(|e| e.to_string()),
            Ok(None) => return Ok(()),
            Err(why) => Err(why),
        };
        let Err(why) = stored else { return Ok(()) };
        let _ = self
            .store
            .finish_sandbox(
                &row.id,
                SandboxStatus::Failed,
                &format!("failed: giving it its secrets: {why}"),
                OffsetDateTime::now_utc(),
                0,
                &sandpit_store::Cause::by(crate::service::events::SANDPIT),
            )
            .await;
        Err(CoreError::internal(format!(
            "sandbox {}: giving it its secrets: {why}",
            row.id
        )))
    }

    /// A broker for sandbox `id`: a new CA, its key sealed for the sandbox.
    fn new_broker(
        &self,
        id: &str,
        placeholders: &[(String, String)],
        rules: Option<&str>,
    ) -> std::result::Result<SandboxBroker, String> {
        let ca = BrokerCa::generate(id)?;
        Ok(SandboxBroker {
            ca_key_sealed: self
                .config
                .secrets_key
                .seal(ca.key_pem.expose().as_bytes(), &broker_ca_place(id)),
            ca_cert: ca.cert_pem,
            secrets: placeholders.to_vec(),
            rules: rules.map(str::to_string),
        })
    }

    /// Live sandbox `row`'s broker made now, with no secrets or rules (a
    /// CA its guest is given at its next egress), unless it has one.
    pub(super) async fn ensure_broker(&self, row: &SandboxRow) -> Result<()> {
        if self.store.sandbox_broker(&row.id).await?.is_some() {
            return Ok(());
        }
        let broker = self
            .new_broker(&row.id, &[], None)
            .map_err(|why| CoreError::internal(format!("sandbox {}'s CA: {why}", row.id)))?;
        self.store.set_sandbox_broker(&row.id, &broker).await?;
        Ok(())
    }

    /// Sandbox `origin`'s broker for its fork `id`: the same CA (its key
    /// sealed anew, for the fork) and placeholders; `None` when it has none.
    async fn origin_broker(
        &self,
        origin: &str,
        id: &str,
    ) -> std::result::Result<Option<SandboxBroker>, String> {
        let Some(broker) = self
            .store
            .sandbox_broker(origin)
            .await
            .map_err(|e| e.to_string())?
        else {
            return Ok(None);
        };
        let key = self
            .config
            .secrets_key
            .open(&broker.ca_key_sealed, &broker_ca_place(origin))?;
        Ok(Some(SandboxBroker {
            ca_key_sealed: self.config.secrets_key.seal(&key, &broker_ca_place(id)),
            ..broker
        }))
    }

    /// What sandbox `row`'s egress proxy brokers: its CA, each of its
    /// secrets the account still has (with hosts), unsealed (a deleted one
    /// is left out: its placeholder goes out as it is), and its network
    /// rules resolved (`rules`, when given, instead of its stored ones:
    /// `Some(None)` for none); `None` without a CA, or when its CA's key
    /// does not open (logged).
    pub(super) async fn broker_of(
        &self,
        row: &SandboxRow,
        rules: Option<Option<&str>>,
    ) -> Option<Broker> {
        let stored = match self.store.sandbox_broker(&row.id).await {
            Ok(stored) => stored?,
            Err(e) => {
                tracing::warn!(sandbox = %row.id, "reading its secrets: {e}; it gets none");
                return None;
            }
        };
        let key = self.config.secrets_key.clone();
        let ca_key = match key.open(&stored.ca_key_sealed, &broker_ca_place(&row.id)) {
            Ok(k) => k,
            Err(why) => {
                tracing::warn!(sandbox = %row.id, "its secrets' CA: {why}; it gets no secrets");
                return None;
            }
        };
        let names: Vec<String> = stored.secrets.iter().map(|(n, _)| n.clone()).collect();
        let values = match self.store.secrets_named(&row.account_id, &names).await {
            Ok(values) => values,
            Err(e) => {
                tracing::warn!(sandbox = %row.id, "reading its secrets: {e}; it gets none");
                return None;
            }
        };
        let mut secrets = Vec::new();
        for (name, placeholder) in stored.secrets {
            let Some((secret, sealed)) = values
                .iter()
                .find(|(s, _)| s.name == name && !s.hosts.is_empty())
            else {
                continue;
            };
            let value = match key.open(sealed, &secret_place(&row.account_id, &name)) {
                Ok(v) => String::from_utf8(v).map_err(|_| "not UTF-8".to_string()),
                Err(why) => Err(why),
            };
            match value {
                Ok(value) => secrets.push(BrokeredSecret {
                    name,
                    placeholder,
                    hosts: secret.hosts.clone(),
                    header: secret.header.clone(),
                    format: secret.format.clone(),
                    value: Sensitive::new(value),
                }),
                Err(why) => {
                    tracing::warn!(sandbox = %row.id, secret = %name, "{why}; it is left out")
                }
            }
        }
        let headers = match rules.unwrap_or(stored.rules.as_deref()) {
            Some(rules) => self.header_rules(row, rules).await,
            None => Vec::new(),
        };
        Some(Broker {
            ca: BrokerCa {
                cert_pem: stored.ca_cert,
                key_pem: Sensitive::new(String::from_utf8_lossy(&ca_key).into_owned()),
            },
            secrets,
            headers,
        })
    }

    /// Sends the account's running sandboxes that use its secret `name`
    /// their egress again: a put or a delete holds from their next request.
    async fn resend_egress_using(&self, caller: &Caller, name: &str) {
        match self
            .store
            .live_sandboxes_using_secret(&caller.account_id, name)
            .await
        {
            Ok(ids) => {
                for id in ids {
                    self.resend_egress(&id).await;
                }
            }
            Err(e) => tracing::warn!(secret = %name, "finding the sandboxes that use it: {e}"),
        }
    }

    /// Sends this member's running sandboxes with secrets their egress
    /// again: a VM's egress proxy that outlived the process that gave it
    /// its values lost them (its record on disk never holds them).
    pub(super) async fn resend_brokered_egress(&self) {
        match self
            .store
            .live_brokered_sandboxes(&self.config.host_name)
            .await
        {
            Ok(ids) => {
                for id in ids {
                    self.resend_egress(&id).await;
                }
            }
            Err(e) => tracing::warn!("finding the sandboxes with secrets: {e}"),
        }
    }

    /// Running sandbox `id`'s VM given its egress as it is now (in its
    /// turn, so no start or pause is given an older one after it); one not
    /// running gets it at its next start. A failure is logged.
    async fn resend_egress(&self, id: &str) {
        let _turn = self.turns.take(id).await;
        let row = match self.store.sandbox(id).await {
            Ok(Some(row)) if row.status == SandboxStatus::Running => row,
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(sandbox = %id, "sending its secrets again: {e}");
                return;
            }
        };
        let egress = self.egress(&row).await;
        let sent = match self.machines_for(&row).await {
            Ok(machines) => machines
                .set_egress(id, egress)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.message),
        };
        if let Err(e) = sent {
            tracing::warn!(sandbox = %id, "sending its secrets again: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(hosts: &[&str], header: Option<&str>, format: Option<&str>) -> PutSecret {
        PutSecret {
            value: "sk-0123".into(),
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            header: header.map(str::to_string),
            format: format.map(str::to_string),
        }
    }

    #[test]
    fn a_put_is_checked_and_says_why_not() {
        let ok = check_put("OPENAI_API_KEY", &put(&["api.openai.com"], None, None)).unwrap();
        assert_eq!(
            (ok.header.as_str(), ok.format.as_str()),
            ("Authorization", "Bearer {value}")
        );
        assert!(check_put(
            "_K1",
            &put(&["*.example.com"], Some("x-api-key"), Some("{value}"))
        )
        .is_ok());
        let why = |name: &str, req: PutSecret| check_put(name, &req).unwrap_err().message;
        let good = || put(&["api.example.com"], None, None);
        assert!(why("1KEY", good()).contains("environment variable"));
        assert!(why("MY-KEY", good()).contains("environment variable"));
        assert!(why(&"K".repeat(65), good()).contains("at most 64"));
        assert!(why(
            "K",
            PutSecret {
                value: String::new(),
                ..good()
            }
        )
        .contains("empty"));
        assert!(why(
            "K",
            PutSecret {
                value: "a\nb".into(),
                ..good()
            }
        )
        .contains("CR, LF"));
        assert!(why(
            "K",
            PutSecret {
                value: "x".repeat(8193),
                ..good()
            }
        )
        .contains("8192"));
        assert!(why("K", put(&[], None, None)).contains("1 to 32"));
        assert!(why("K", put(&["exa mple.com"], None, None)).contains("not a host name"));
        assert!(why("K", put(&["*.com"], None, None)).contains("top-level"));
        assert!(why("K", put(&["a.com"], Some("bad header"), None)).contains("header name"));
        assert!(why("K", put(&["a.com"], None, Some("Bearer"))).contains("exactly once"));
        assert!(why("K", put(&["a.com"], None, Some("{value}{value}"))).contains("exactly once"));
        let hosts: Vec<String> = (0..33).map(|i| format!("h{i}.example.com")).collect();
        let many = PutSecret { hosts, ..good() };
        assert!(why("K", many).contains("not 33"));
    }

    #[test]
    fn placeholders_are_fresh_and_long() {
        let p = new_placeholder();
        assert!(p.starts_with("sandpit-secret-"));
        let hex = &p["sandpit-secret-".len()..];
        assert_eq!(hex.len(), 40);
        assert!(hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        assert_ne!(p, new_placeholder());
    }

    /// A sandbox row of `account_id` in the store, as a create makes it.
    async fn sandbox_row(svc: &Service, account_id: &str) -> SandboxRow {
        let at = OffsetDateTime::now_utc();
        let new = sandpit_store::NewSandbox {
            id: sandpit_host::ids::new_id("sbx_"),
            account_id: account_id.to_string(),
            name: None,
            size: "small".into(),
            vcpus: 1,
            memory_mb: 512,
            disk_gb: 10,
            timeout_minutes: 15,
            price_micros_per_hour: 0,
            host: svc.config.host_name.clone(),
            host_epoch: None,
            snapshot_id: None,
            created_at: at,
            expires_at: at + time::Duration::minutes(15),
            reserve_micros: 0,
            max_concurrent: None,
            disk_limit_bytes: None,
            idempotency: None,
            metadata: Default::default(),
            env: Default::default(),
            access_token: None,
            every_port_public: false,
            internet_access: None,
            network: None,
            template_id: None,
            workdir: None,
            start_from: None,
            cause: Default::default(),
        };
        match svc.store.create_sandbox(new).await.unwrap() {
            sandpit_store::CreateOutcome::Created(row) => row,
            other => panic!("{other:?}"),
        }
    }

    /// A create's secrets become its VM's broker, with their values; a
    /// fork's is its origin's CA and placeholders; a deleted secret is
    /// left out; a broker that does not open under the key is left out.
    #[tokio::test]
    async fn every_start_of_a_vm_is_given_its_secrets_values() {
        let dir = tempfile::tempdir().unwrap();
        let store = sandpit_store::Store::open_sqlite(dir.path().join("sandpit.db"))
            .await
            .unwrap();
        let config = crate::config::ServiceConfig::default();
        let acct = crate::admin::create_account(&store, &config, "ann", 1.0)
            .await
            .unwrap();
        let svc = Service::without_vms(config, store.clone());
        let me = Caller::new(acct.id.clone(), "test");
        for (name, value) in [("OPENAI_API_KEY", "sk-openai"), ("OTHER", "sk-other")] {
            svc.put_secret(&me, name, put(&["api.openai.com"], None, None))
                .await
                .unwrap();
            let req = PutSecret {
                value: value.into(),
                ..put(&["api.openai.com"], None, None)
            };
            svc.put_secret(&me, name, req).await.unwrap();
        }
        let req = CreateSandbox {
            secrets: vec!["OPENAI_API_KEY".into()],
            ..Default::default()
        };
        let placeholders = svc.placeholders_for(&me, &req).await.unwrap();
        let row = sandbox_row(&svc, &acct.id).await;
        svc.give_broker(&row, &placeholders, None, None)
            .await
            .unwrap();
        let egress = svc.egress(&row).await;
        assert!(egress.brokers());
        let broker = egress.broker.clone().unwrap();
        assert!(broker.ca.cert_pem.contains("BEGIN CERTIFICATE"));
        assert!(broker.ca.key_pem.expose().contains("PRIVATE KEY"));
        assert_eq!(broker.secrets.len(), 1);
        let secret = &broker.secrets[0];
        assert_eq!(secret.placeholder, placeholders[0].1);
        assert_eq!(secret.value.expose(), "sk-openai");
        assert_eq!(secret.format, "Bearer {value}");

        // A fork: the same CA and placeholders, its own sealing.
        let fork = sandbox_row(&svc, &acct.id).await;
        svc.give_broker(&fork, &[], None, Some(&row.id))
            .await
            .unwrap();
        let forked = svc.egress(&fork).await.broker.unwrap();
        assert_eq!(forked, broker);
        let stored = store.sandbox_broker(&fork.id).await.unwrap().unwrap();
        let origin = store.sandbox_broker(&row.id).await.unwrap().unwrap();
        assert_ne!(stored.ca_key_sealed, origin.ca_key_sealed);

        // Deleted: left out, the CA stays.
        svc.delete_secret(&me, "OPENAI_API_KEY").await.unwrap();
        let left = svc.egress(&row).await.broker.unwrap();
        assert!(left.secrets.is_empty());
        assert!(!svc.egress(&row).await.brokers());

        // Under another key nothing opens: no broker, the VM starts anyway.
        let other = Service::without_vms(crate::config::ServiceConfig::default(), store);
        assert_eq!(other.egress(&row).await.broker, None);

        // A create naming a variable of its env, or a name twice: refused.
        let clash = CreateSandbox {
            secrets: vec!["OTHER".into()],
            env: [("OTHER".to_string(), "x".to_string())].into(),
            ..Default::default()
        };
        let e = svc.placeholders_for(&me, &clash).await.unwrap_err();
        assert!(
            e.message.contains("both a secret and a variable"),
            "{}",
            e.message
        );
        let twice = CreateSandbox {
            secrets: vec!["OTHER".into(), "OTHER".into()],
            ..Default::default()
        };
        let e = svc.placeholders_for(&me, &twice).await.unwrap_err();
        assert!(e.message.contains("twice"), "{}", e.message);
    }

    #[test]
    fn e2b_names_and_metadata_are_checked_as_e2b_does() {
        assert_eq!(check_e2b_name("My-Key_1").unwrap(), "my-key_1");
        let why = |name: &str| check_e2b_name(name).unwrap_err().message;
        assert!(why("").contains("letters, digits"));
        assert!(why("a{b}").contains("letters, digits"));
        assert!(why("a\u{7}b").contains("letters, digits"));
        assert!(why("a.b").contains("letters, digits"));
        assert!(why("SEC_x").contains("reserved"));
        assert!(why(&"k".repeat(129)).contains("at most 128"));
        assert!(check_e2b_name(&"k".repeat(128)).is_ok());
        let meta = |pairs: Vec<(String, String)>| check_metadata(&pairs.into_iter().collect());
        assert_eq!(meta(vec![]).unwrap(), "{}");
        assert_eq!(
            meta(vec![("team".into(), "a".into())]).unwrap(),
            r#"{"team":"a"}"#
        );
        let many = (0..33).map(|i| (format!("k{i}"), "v".into())).collect();
        assert!(meta(many).unwrap_err().message.contains("at most 32"));
        let long_key = vec![("k".repeat(129), "v".into())];
        assert!(meta(long_key).unwrap_err().message.contains("128"));
        let long_value = vec![("k".into(), "v".repeat(1025))];
        assert!(meta(long_value).unwrap_err().message.contains("1024"));
        let big = (0..9)
            .map(|i| (format!("k{i}"), "v".repeat(1000)))
            .collect();
        assert!(meta(big).unwrap_err().message.contains("8192"));
    }

    #[test]
    fn a_rules_template_resolves_its_secrets_and_nothing_else() {
        let values = |name: &str| match name {
            "my-key" => Some("sk-1".to_string()),
            "other" => Some("sk-2".to_string()),
            _ => None,
        };
        assert_eq!(
            resolve_template("Bearer ${e2b.secrets.my-key}", values).unwrap(),
            ("Bearer sk-1".to_string(), vec!["my-key".to_string()])
        );
        assert_eq!(
            resolve_template(
                "${e2b.secrets.my-key}:${e2b.secrets.other}:${e2b.secrets.my-key}",
                values
            )
            .unwrap(),
            (
                "sk-1:sk-2:sk-1".to_string(),
                vec!["my-key".to_string(), "other".to_string()]
            )
        );
        // Plain text, and `$` that is no reference, go as they are.
        assert_eq!(
            resolve_template("cost $5 ${HOME}", values).unwrap(),
            ("cost $5 ${HOME}".to_string(), vec![])
        );
        assert_eq!(
            resolve_template("Bearer ${e2b.secrets.gone}", values).unwrap_err(),
            "gone"
        );
        assert!(parse_template("${e2b.iam.tokens.aws}")
            .unwrap_err()
            .contains("only ${e2b.secrets.NAME}"));
        assert!(parse_template("${e2b.secrets.x")
            .unwrap_err()
            .contains("does not end"));
        assert!(parse_template("${e2b.secrets.}").is_err());
    }

    #[test]
    fn rules_are_checked_and_say_why_not() {
        let rules = |host: &str, header: &str, value: &str| -> NetworkRules {
            [(
                host.to_string(),
                [(header.to_string(), value.to_string())].into(),
            )]
            .into()
        };
        assert_eq!(
            check_rules(&rules(
                "api.example.com",
                "Authorization",
                "Bearer ${e2b.secrets.a} ${e2b.secrets.b} ${e2b.secrets.a}"
            ))
            .unwrap(),
            vec!["a", "b"]
        );
        assert!(check_rules(&rules("*.example.com", "X-Team", "plain")).is_ok());
        let why = |r: NetworkRules| check_rules(&r).unwrap_err().message;
        assert!(why(rules("exa mple.com", "A", "v")).contains("not a host name"));
        assert!(why(rules("10.0.0.1", "A", "v")).contains("host name"));
        assert!(why(rules("a.com", "bad header", "v")).contains("header name"));
        assert!(why(rules("a.com", "A", "")).contains("1 to"));
        assert!(why(rules("a.com", "A", "a\nb")).contains("CR, LF"));
        assert!(why(rules("a.com", "A", "${e2b.iam.tokens.x}")).contains("not supported"));
        let many: NetworkRules = (0..33)
            .map(|i| (format!("h{i}.example.com"), BTreeMap::new()))
            .collect();
        assert!(why(many).contains("at most 32"));
    }

    /// E2B's secrets: created (lower-cased, version 1, metadata), found by
    /// id and by name, given a new value (version 2), listed with the
    /// REST API's (no hosts); refused in a create's `secrets`; a sandbox's
    /// rules name them and its broker sets their headers, resolved.
    #[tokio::test]
    async fn e2b_secrets_are_the_same_secrets_and_rules_resolve_them() {
        let dir = tempfile::tempdir().unwrap();
        let store = sandpit_store::Store::open_sqlite(dir.path().join("sandpit.db"))
            .await
            .unwrap();
        let config = crate::config::ServiceConfig::default();
        let acct = crate::admin::create_account(&store, &config, "ann", 1.0)
            .await
            .unwrap();
        let svc = Service::without_vms(config, store.clone());
        let me = Caller::new(acct.id.clone(), "test");
        let made = svc
            .create_secret(
                &me,
                "My-Key",
                "sk-e2b-1".into(),
                [("team".to_string(), "a".to_string())].into(),
            )
            .await
            .unwrap();
        assert_eq!((made.name.as_str(), made.version), ("my-key", 1));
        assert!(made.id.starts_with("sec_"));
        assert!(made.hosts.is_empty());
        assert_eq!(made.metadata["team"], "a");
        let again = svc
            .create_secret(&me, "my-key", "x".into(), BTreeMap::new())
            .await
            .unwrap_err();
        assert_eq!(again.kind, ErrorType::Conflict);
        assert_eq!(svc.get_secret(&me, &made.id).await.unwrap(), made);
        assert_eq!(svc.get_secret(&me, "MY-KEY").await.unwrap(), made);
        let missing = svc.get_secret(&me, "nothere").await.unwrap_err();
        assert_eq!(missing.kind, ErrorType::NotFound);
        let two = svc
            .update_secret(&me, &made.id, "sk-e2b-2".into(), None)
            .await
            .unwrap();
        assert_eq!((two.version, two.metadata["team"].as_str()), (2, "a"));
        assert_eq!(svc.list_secrets(&me).await.unwrap().data, vec![two.clone()]);

        // Not a placeholder's: it names no host.
        let req = CreateSandbox {
            secrets: vec!["my_key".into()],
            ..Default::default()
        };
        svc.create_secret(&me, "my_key", "v".into(), BTreeMap::new())
            .await
            .unwrap();
        let e = svc.placeholders_for(&me, &req).await.unwrap_err();
        assert!(e.message.contains("names no host"), "{}", e.message);

        // Rules: an unknown secret refused; the sandbox's broker sets the
        // header, resolved from the current value.
        let rules = |template: &str| -> NetworkRules {
            [(
                "api.example.com".to_string(),
                [("Authorization".to_string(), template.to_string())].into(),
            )]
            .into()
        };
        let e = svc
            .stored_rules(&me, &rules("Bearer ${e2b.secrets.nope}"))
            .await
            .unwrap_err();
        assert!(
            e.message.contains("no secret named \"nope\""),
            "{}",
            e.message
        );
        assert_eq!(
            svc.stored_rules(&me, &NetworkRules::new()).await.unwrap(),
            None
        );
        let stored = svc
            .stored_rules(&me, &rules("Bearer ${e2b.secrets.my-key}"))
            .await
            .unwrap();
        let row = sandbox_row(&svc, &acct.id).await;
        svc.give_broker(&row, &[], stored.as_deref(), None)
            .await
            .unwrap();
        let broker = svc.egress(&row).await.broker.unwrap();
        assert!(broker.secrets.is_empty());
        assert_eq!(broker.headers.len(), 1);
        let header = &broker.headers[0];
        assert_eq!(header.hosts, ["api.example.com"]);
        assert_eq!(header.header, "Authorization");
        assert_eq!(header.value.expose(), "Bearer sk-e2b-2");
        assert_eq!(header.secrets, ["my-key"]);
        // A fork keeps them.
        let fork = sandbox_row(&svc, &acct.id).await;
        svc.give_broker(&fork, &[], None, Some(&row.id))
            .await
            .unwrap();
        assert_eq!(
            svc.egress(&fork).await.broker.unwrap().headers,
            broker.headers
        );
        // Given rules of its own (as an update does): those instead.
        let other = svc
            .stored_rules(&me, &rules("Token ${e2b.secrets.my_key}"))
            .await
            .unwrap();
        let with = svc.broker_of(&row, Some(other.as_deref())).await.unwrap();
        assert_eq!(with.headers[0].value.expose(), "Token v");
        let none = svc.broker_of(&row, Some(None)).await.unwrap();
        assert!(none.headers.is_empty());
        // Deleted (by id): its header is no longer set.
        svc.delete_secret(&me, &made.id).await.unwrap();
        assert!(svc.egress(&row).await.broker.unwrap().headers.is_empty());
        let e = svc.get_secret(&me, &made.id).await.unwrap_err();
        assert_eq!(e.kind, ErrorType::NotFound);
    }

    #[test]
    fn a_put_never_shows_its_value() {
        let shown = format!("{:?}", put(&["a.com"], None, None));
        assert!(!shown.contains("sk-0123"), "{shown}");
    }
}
