//! Secrets brokered on the host: an account's credentials that a sandbox
//! uses without ever holding them.
//!
//! The guest has a placeholder in an environment variable (see the core's
//! `secrets`); its egress proxy, for the hosts a secret may go to and for
//! those alone, ends the guest's TLS with a certificate of the sandbox's own
//! CA (which the guest's trust store holds, nothing else does), puts the
//! value where the guest put the placeholder in the secret's header, and
//! sends the request on over a new TLS connection to the real server,
//! verified against the host's trust store. Everything else (other hosts,
//! other headers, plain HTTP) goes out as the guest wrote it: a placeholder
//! is worthless anywhere but on that path.
//!
//! Why on the host: a value in the guest can be printed, sent anywhere, or
//! kept in a snapshot forked a hundred times; the placeholder can only be
//! turned into the value by this process, on a connection it made itself
//! to a server that proved it is the secret's host.
//!
//! A sandbox may also have headers set on its requests to some hosts
//! ([`HeaderRule`], E2B's network rules): their values, resolved by the
//! service from the account's secrets (`Bearer ${e2b.secrets.NAME}`), are
//! set on the same path, the guest's own header of that name replaced; the
//! guest never holds even a placeholder.
//!
//! The values and the CA's key are [`Sensitive`]: never logged, never in a
//! VM's record on disk (see [`Broker::without_values`]), wiped from memory
//! when dropped.

use super::names::NameRule;
use serde::{Deserialize, Serialize};
use zeroize::Zeroize;

/// A value that must not be shown: its `Debug` is redacted, it is wiped
/// when dropped. Serialized as it is (the node API carries it, over mutual
/// TLS), so what writes to disk strips it first.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Sensitive(String);

impl Sensitive {
    pub fn new(value: impl Into<String>) -> Sensitive {
        Sensitive(value.into())
    }

    /// The value itself, for the one place that uses it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Sensitive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Drop for Sensitive {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

/// One secret a sandbox may use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrokeredSecret {
    /// The account's name for it (the guest's variable), for logs.
    pub name: String,
    /// What the guest has instead of the value.
    pub placeholder: String,
    /// The hosts it may be sent to: names, `*.` wildcards allowed.
    pub hosts: Vec<String>,
    /// The request header it goes in (`Authorization`, `x-api-key`).
    pub header: String,
    /// That header's value when the guest sent the placeholder alone in it:
    /// `{value}` stands for the value (`Bearer {value}`).
    pub format: String,
    /// The value; empty in a VM's record on disk (then nothing is put in).
    pub value: Sensitive,
}

/// A header set on every HTTPS request of the guest's to some hosts,
/// whatever it sent in it (E2B's network rules).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeaderRule {
    /// The hosts whose requests get it: names, `*.` wildcards allowed.
    pub hosts: Vec<String>,
    /// The header's name.
    pub header: String,
    /// Its value, secrets resolved; empty in a VM's record on disk (then
    /// nothing is set).
    pub value: Sensitive,
    /// The names of the secrets its value holds, for logs.
    pub secrets: Vec<String>,
}

/// A sandbox's own certificate authority: its guest trusts it, its egress
/// proxy signs a certificate for a secret's host with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrokerCa {
    /// The CA's certificate (PEM), added to the guest's trust store.
    pub cert_pem: String,
    /// Its key (PEM); empty in a VM's record on disk.
    pub key_pem: Sensitive,
}

impl BrokerCa {
    /// A new CA for sandbox `sandbox`, valid ten years (a sandbox lives a
    /// day at most, but a snapshot of it may be started much later).
    pub fn generate(sandbox: &str) -> Result<BrokerCa, String> {
        use rcgen::{
            BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair,
            KeyUsagePurpose,
        };
        let key = KeyPair::generate().map_err(|e| format!("generating a CA key: {e}"))?;
        let mut params =
            CertificateParams::new(Vec::<String>::new()).map_err(|e| format!("a CA: {e}"))?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "Sandpit");
        dn.push(
            DnType::CommonName,
            format!("Sandpit secrets broker for {sandbox}"),
        );
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(3650);
        let cert = params
            .self_signed(&key)
            .map_err(|e| format!("signing a CA: {e}"))?;
        Ok(BrokerCa {
            cert_pem: cert.pem(),
            key_pem: Sensitive::new(key.serialize_pem()),
        })
    }
}

/// What a sandbox's egress proxy brokers: its CA, its secrets and the
/// headers it sets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Broker {
    pub ca: BrokerCa,
    pub secrets: Vec<BrokeredSecret>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<HeaderRule>,
}

impl Broker {
    /// Checked: each secret's hosts are name rules, its header a header
    /// name, its format holds `{value}` once, its placeholder is long
    /// enough not to be guessed and appears in no other; each header rule's
    /// hosts are name rules, its header a header name, its value a
    /// header's.
    pub fn checked(self) -> Result<Broker, String> {
        for s in &self.secrets {
            if s.hosts.is_empty() {
                return Err(format!("secret {}: it names no host", s.name));
            }
            for h in &s.hosts {
                NameRule::parse(h).map_err(|e| format!("secret {}: {e}", s.name))?;
            }
            if http::HeaderName::from_bytes(s.header.as_bytes()).is_err() {
                return Err(format!(
                    "secret {}: {:?} is not a header name",
                    s.name, s.header
                ));
            }
            if s.format.matches("{value}").count() != 1 {
                return Err(format!(
                    "secret {}: its format holds {{value}} once ({:?} does not)",
                    s.name, s.format
                ));
            }
            if s.placeholder.len() < 24 {
                return Err(format!("secret {}: a placeholder that short", s.name));
            }
        }
        for h in &self.headers {
            if h.hosts.is_empty() {
                return Err(format!("header {}: it names no host", h.header));
            }
            for host in &h.hosts {
                NameRule::parse(host).map_err(|e| format!("header {}: {e}", h.header))?;
            }
            if http::HeaderName::from_bytes(h.header.as_bytes()).is_err() {
                return Err(format!("{:?} is not a header name", h.header));
            }
            if http::HeaderValue::from_str(h.value.expose()).is_err() {
                return Err(format!("header {}: its value is not a header's", h.header));
            }
        }
        Ok(self)
    }

    /// The same without its values and the CA's key: what a VM's record on
    /// disk holds. A proxy started from it (after this process restarted,
    /// before the service gave the values again) puts nothing in and ends
    /// no TLS.
    pub fn without_values(&self) -> Broker {
        Broker {
            ca: BrokerCa {
                cert_pem: self.ca.cert_pem.clone(),
                key_pem: Sensitive::default(),
            },
            secrets: self
                .secrets
                .iter()
                .map(|s| BrokeredSecret {
                    value: Sensitive::default(),
                    ..s.clone()
                })
                .collect(),
            headers: self
                .headers
                .iter()
                .map(|h| HeaderRule {
                    value: Sensitive::default(),
                    ..h.clone()
                })
                .collect(),
        }
    }

    /// Whether it can broker anything: it has the CA's key and a value.
    pub fn is_usable(&self) -> bool {
        !self.ca.key_pem.is_empty()
            && (self.secrets.iter().any(|s| !s.value.is_empty())
                || self.headers.iter().any(|h| !h.value.is_empty()))
    }
}
