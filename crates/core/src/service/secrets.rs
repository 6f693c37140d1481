//! Secrets that never enter the VM (`Secrets`): an account's credentials,
//! stored sealed (see [`crate::secrets_key`]), and what a sandbox created
//! with some of them has instead: a placeholder in an environment variable
//! of each of its commands, its own CA, and a broker its host's egress
//! proxy is given at every start of its VM, which puts the value in place
//! of the placeholder in HTTPS requests to the secret's hosts only (see
//! `sandpit_runtime::egress::broker`).
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
use sandpit_runtime::{Broker, BrokerCa, BrokeredSecret, Sensitive};
use sandpit_store::{NewSecret, SandboxBroker, SandboxRow, SecretRow};
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
    let value = &req.value;
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
        let rows = self.store.list_secrets(&caller.account_id).await?;
        Ok(List::new(rows.iter().map(to_secret).collect(), false, None))
    }

    async fn delete_secret(&self, caller: &Caller, name: &str) -> Result<Secret> {
        let Some(row) = self.store.delete_secret(&caller.account_id, name).await? else {
            return Err(no_secret(name));
        };
        self.resend_egress_using(caller, name).await;
        Ok(to_secret(&row))
    }
}

impl Service {
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
        Ok(req
            .secrets
            .iter()
            .map(|name| (name.clone(), new_placeholder()))
            .collect())
    }

    /// New sandbox `row`'s broker, before its VM starts: a CA of its own
    /// and `placeholders` (see [`Service::placeholders_for`]), or a fork's
    /// origin's (`secrets_of`: its guest trusts that CA and holds those
    /// placeholders already). A sandbox whose broker cannot be stored ends
    /// failed, its reservation given back, rather than start without it.
    pub(super) async fn give_broker(
        &self,
        row: &SandboxRow,
        placeholders: &[(String, String)],
        secrets_of: Option<&str>,
    ) -> Result<()> {
        let made = match (placeholders.is_empty(), secrets_of) {
            (false, _) => self.new_broker(&row.id, placeholders).map(Some),
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
    ) -> std::result::Result<SandboxBroker, String> {
        let ca = BrokerCa::generate(id)?;
        Ok(SandboxBroker {
            ca_key_sealed: self
                .config
                .secrets_key
                .seal(ca.key_pem.expose().as_bytes(), &broker_ca_place(id)),
            ca_cert: ca.cert_pem,
            secrets: placeholders.to_vec(),
        })
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

    /// What sandbox `row`'s egress proxy brokers: its CA and each of its
    /// secrets the account still has, unsealed (a deleted one is left out:
    /// its placeholder goes out as it is); `None` without secrets, or when
    /// its CA's key does not open (logged).
    pub(super) async fn broker_of(&self, row: &SandboxRow) -> Option<Broker> {
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
            let Some((secret, sealed)) = values.iter().find(|(s, _)| s.name == name) else {
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
        Some(Broker {
            ca: BrokerCa {
                cert_pem: stored.ca_cert,
                key_pem: Sensitive::new(String::from_utf8_lossy(&ca_key).into_owned()),
            },
            secrets,
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
        let me = Caller {
            account_id: acct.id.clone(),
        };
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
        svc.give_broker(&row, &placeholders, None).await.unwrap();
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
        svc.give_broker(&fork, &[], Some(&row.id)).await.unwrap();
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
    fn a_put_never_shows_its_value() {
        let shown = format!("{:?}", put(&["a.com"], None, None));
        assert!(!shown.contains("sk-0123"), "{shown}");
    }
}
