//! The cluster's own certificate authority and the mutual TLS it gives.
//!
//! `sandpit cluster init DIR` makes a CA (`ca.pem`, `ca.key`) for one
//! cluster; `sandpit cluster issue DIR NAME` gives a member (a node, a
//! control-plane replica, or one process that is both) a certificate of its
//! own, signed by that CA, naming it and the addresses it is reached at.
//! Every connection between members is TLS 1.3 (or 1.2) where *both* ends
//! show a certificate of this CA: a node accepts nothing from anyone else,
//! and a replica talks only to the nodes the operator enrolled.
//!
//! The CA key signs members' certificates and nothing else; it need not be
//! on any member (copy each member its `NAME.pem`, `NAME.key` and `ca.pem`).
//! Keys are written 0600.

use anyhow::{bail, Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// How long a member's certificate is valid.
const MEMBER_DAYS: i64 = 825;
/// How long the CA is valid.
const CA_DAYS: i64 = 3650;

/// The files of one member's identity.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The CA certificate every peer must be signed by.
    pub ca: PathBuf,
    /// This member's certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
}

impl Identity {
    /// `DIR/ca.pem`, `DIR/NAME.pem`, `DIR/NAME.key`: what `issue` wrote.
    pub fn in_dir(dir: &Path, name: &str) -> Identity {
        Identity {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
        }
    }
}

fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}

fn validity(params: &mut CertificateParams, days: i64) {
    let now = time::OffsetDateTime::now_utc();
    // A little slack for members whose clocks run behind.
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(days);
}

/// Makes a new CA in `dir` (`ca.pem`, `ca.key`); refuses to overwrite one.
pub fn init_ca(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    if dir.join("ca.key").exists() || dir.join("ca.pem").exists() {
        bail!(
            "{} already holds a cluster CA; issue certificates from it, or choose another \
             directory",
            dir.display()
        );
    }
    let key = KeyPair::generate().context("generating the CA key")?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "Sandpit cluster");
    dn.push(DnType::CommonName, "Sandpit cluster CA");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut params, CA_DAYS);
    let cert = params.self_signed(&key).context("signing the CA")?;
    write_private(&dir.join("ca.key"), &key.serialize_pem())?;
    std::fs::write(dir.join("ca.pem"), cert.pem())?;
    Ok(())
}

/// Issues `NAME.pem` and `NAME.key` in `dir` from its CA, for a member
/// named `name` and reached at `hosts` (DNS names or IP addresses; the name
/// itself is always one).
pub fn issue(dir: &Path, name: &str, hosts: &[String]) -> Result<Identity> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
    {
        bail!("a member's name is letters, digits, '-', '.' and '_', not {name:?}");
    }
    let ca_pem = std::fs::read_to_string(dir.join("ca.pem")).with_context(|| {
        format!(
            "reading {}/ca.pem (run `sandpit cluster init` first)",
            dir.display()
        )
    })?;
    let ca_key = KeyPair::from_pem(
        &std::fs::read_to_string(dir.join("ca.key"))
            .with_context(|| format!("reading {}/ca.key", dir.display()))?,
    )
    .context("parsing the CA key")?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).context("parsing the CA certificate")?;

    let mut params = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "Sandpit cluster");
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    let mut sans = vec![name.to_string()];
    sans.extend(hosts.iter().cloned());
    sans.dedup();
    for h in &sans {
        params
            .subject_alt_names
            .push(match h.parse::<std::net::IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(
                    h.as_str()
                        .try_into()
                        .with_context(|| format!("{h:?} is not a DNS name or an IP address"))?,
                ),
            });
    }
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    // Each member is both: a server to some, a client of others.
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    validity(&mut params, MEMBER_DAYS);
    let key = KeyPair::generate().context("generating the member's key")?;
    let cert = params
        .signed_by(&key, &issuer)
        .context("signing the member's certificate")?;
    let id = Identity::in_dir(dir, name);
    write_private(&id.key, &key.serialize_pem())?;
    std::fs::write(&id.cert, cert.pem())?;
    Ok(id)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(ca: &Path) -> Result<Arc<rustls::RootCertStore>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca)
        .with_context(|| format!("reading the cluster CA {}", ca.display()))?
    {
        roots
            .add(cert.with_context(|| format!("parsing {}", ca.display()))?)
            .context("the cluster CA")?;
    }
    if roots.is_empty() {
        bail!("{} holds no certificate", ca.display());
    }
    Ok(Arc::new(roots))
}

fn chain_and_key(id: &Identity) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    let chain = CertificateDer::pem_file_iter(&id.cert)
        .with_context(|| format!("reading {}", id.cert.display()))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .with_context(|| format!("parsing {}", id.cert.display()))?;
    let key = PrivateKeyDer::from_pem_file(&id.key)
        .with_context(|| format!("reading {}", id.key.display()))?;
    Ok((chain, key))
}

/// The TLS of a member's server end: its own certificate, and a client
/// certificate signed by the cluster CA required of every peer.
pub fn server_config(id: &Identity) -> Result<Arc<rustls::ServerConfig>> {
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(&id.ca)?, provider())
            .build()
            .context("the client certificate verifier")?;
    let (chain, key) = chain_and_key(id)?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .context("the member's certificate and key do not fit together")?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// The TLS of a member's client end: the cluster CA as the only root, and
/// its own certificate shown to the server.
pub fn client_config(id: &Identity) -> Result<Arc<rustls::ClientConfig>> {
    let (chain, key) = chain_and_key(id)?;
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots(&id.ca)?)
        .with_client_auth_cert(chain, key)
        .context("the member's certificate and key do not fit together")?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// The name a client checks the server's certificate against: the host of
/// `address` (`host:port`).
pub fn server_name(address: &str) -> Result<ServerName<'static>> {
    let host = match address.rsplit_once(':') {
        Some((h, port)) if port.parse::<u16>().is_ok() => h,
        _ => address,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string())
        .with_context(|| format!("{address:?} does not name a host"))
}
