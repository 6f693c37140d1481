//! The secret-injecting path of an egress proxy (see [`super::broker`]): a
//! guest's TLS connection to a secret's host (or a host a header rule
//! names), ended here with a certificate of the sandbox's CA, its HTTP/1.1
//! requests given the secret's value in place of the placeholder (and the
//! rules' headers set), and sent on over this process's own TLS connection
//! to the server, verified against the host's trust store.
//!
//! The order is what keeps a value from going astray: the server is
//! reached and verified for the name the guest asked for *before* the
//! guest's handshake completes (a server that fails verification resets
//! the guest, as a refusal does), each request must name that same host in
//! its `Host` (else 421, nothing sent), and only the secrets whose hosts
//! match that name are put in, in their own header only (a header rule's
//! likewise). Plain HTTP is never given a value: nothing proves where it
//! goes. HTTP/2 is not
//! offered to the guest (ALPN `http/1.1`), so every client falls back to
//! the protocol read here.

use super::broker::{Broker, BrokeredSecret, HeaderRule};
use super::names::NameRule;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::io;
use std::net::SocketAddrV4;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use time::OffsetDateTime;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::rustls;

/// How long the server's TLS handshake, or the guest's, may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// A sandbox's broker, ready to serve: its CA's issuer, the certificates
/// made for the hosts its guest reached so far, and when each secret was
/// last put in.
pub struct BrokerPath {
    broker: Broker,
    rules: Vec<(NameRule, usize)>,
    /// The header rules' hosts, with each rule's index.
    header_rules: Vec<(NameRule, usize)>,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    served: Mutex<HashMap<String, Arc<rustls::ServerConfig>>>,
    last_used: LastUsed,
}

/// When each secret was last put into a request (by name): shared by the
/// broker paths a proxy has had, so a VM's egress given anew (a secret
/// changed, its rules replaced) keeps what was used before.
pub type LastUsed = Arc<Mutex<HashMap<String, OffsetDateTime>>>;

impl BrokerPath {
    /// `None` when `broker` has nothing to put in (no values, no CA key:
    /// as a VM's record on disk holds it) or its CA does not parse.
    pub fn new(broker: &Broker) -> Option<BrokerPath> {
        if !broker.is_usable() {
            return None;
        }
        let key = rcgen::KeyPair::from_pem(broker.ca.key_pem.expose())
            .map_err(|e| tracing::warn!("a broker's CA key: {e}"))
            .ok()?;
        let issuer = rcgen::Issuer::from_ca_cert_pem(&broker.ca.cert_pem, key)
            .map_err(|e| tracing::warn!("a broker's CA certificate: {e}"))
            .ok()?;
        let rules = broker
            .secrets
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.value.is_empty())
            .flat_map(|(i, s)| {
                s.hosts
                    .iter()
                    .filter_map(move |h| NameRule::parse(h).ok().map(|r| (r, i)))
            })
            .collect();
        let header_rules = broker
            .headers
            .iter()
            .enumerate()
            .filter(|(_, h)| !h.value.is_empty())
            .flat_map(|(i, h)| {
                h.hosts
                    .iter()
                    .filter_map(move |host| NameRule::parse(host).ok().map(|r| (r, i)))
            })
            .collect();
        Some(BrokerPath {
            broker: broker.clone(),
            rules,
            header_rules,
            issuer,
            served: Mutex::new(HashMap::new()),
            last_used: LastUsed::default(),
        })
    }

    /// This path, noting its secrets' use in `used`.
    pub fn noting_use_in(mut self, used: LastUsed) -> BrokerPath {
        self.last_used = used;
        self
    }

    /// The secrets that may go to `host`.
    pub fn secrets_for(&self, host: &str) -> Vec<&BrokeredSecret> {
        let mut found: Vec<usize> = self
            .rules
            .iter()
            .filter(|(rule, _)| rule.matches(host))
            .map(|(_, i)| *i)
            .collect();
        found.dedup();
        found.iter().map(|i| &self.broker.secrets[*i]).collect()
    }

    /// The header rules for `host`.
    pub fn headers_for(&self, host: &str) -> Vec<&HeaderRule> {
        let mut found: Vec<usize> = self
            .header_rules
            .iter()
            .filter(|(rule, _)| rule.matches(host))
            .map(|(_, i)| *i)
            .collect();
        found.dedup();
        found.iter().map(|i| &self.broker.headers[*i]).collect()
    }

    /// Whether the guest's TLS for `host` is ended here: a secret may go
    /// to it, or a header rule names it.
    pub fn brokers_for(&self, host: &str) -> bool {
        !self.secrets_for(host).is_empty() || !self.headers_for(host).is_empty()
    }

    /// When each secret was last put into a request (by name).
    pub fn last_used(&self) -> HashMap<String, OffsetDateTime> {
        self.last_used.lock().unwrap().clone()
    }

    /// The guest's TLS for `host` ended with a certificate of the CA for
    /// that name (made once per name).
    fn server_config(&self, host: &str) -> io::Result<Arc<rustls::ServerConfig>> {
        if let Some(c) = self.served.lock().unwrap().get(host) {
            return Ok(c.clone());
        }
        let key = rcgen::KeyPair::generate().map_err(io::Error::other)?;
        let mut params =
            rcgen::CertificateParams::new(vec![host.to_string()]).map_err(io::Error::other)?;
        let now = OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(7);
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(io::Error::other)?;
        let chain = vec![cert.der().clone()];
        let key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der())
            .map_err(io::Error::other)?;
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(io::Error::other)?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(io::Error::other)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let config = Arc::new(config);
        self.served
            .lock()
            .unwrap()
            .insert(host.to_string(), config.clone());
        Ok(config)
    }

    /// Serve a guest connection to `host` (its SNI), whose first bytes (its
    /// ClientHello) are `first`, with `server` already reached for it (see
    /// [`reach`]): the guest's TLS ended with a certificate of the CA for
    /// that name, its requests sent on with the secrets put in.
    pub async fn serve(
        self: Arc<Self>,
        guest: TcpStream,
        first: Vec<u8>,
        host: &str,
        server: Server,
        sandbox: &str,
    ) -> io::Result<()> {
        let config = self.server_config(host)?;
        let guest = tokio::time::timeout(
            HANDSHAKE_TIMEOUT,
            tokio_rustls::TlsAcceptor::from(config).accept(Replay::new(first, guest)),
        )
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the guest's handshake"))??;
        // Header names go on as the guest wrote them (`Authorization`,
        // not hyper's `authorization`): some servers still compare them.
        let (sender, connection) = hyper::client::conn::http1::Builder::new()
            .preserve_header_case(true)
            .handshake(TokioIo::new(server))
            .await
            .map_err(io::Error::other)?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let sender = Arc::new(tokio::sync::Mutex::new(sender));
        let (host, sandbox) = (host.to_string(), sandbox.to_string());
        let service = hyper::service::service_fn(move |request: Request<Incoming>| {
            let (path, sender, host, sandbox) =
                (self.clone(), sender.clone(), host.clone(), sandbox.clone());
            async move { Ok::<_, hyper::Error>(path.forward(request, &sender, &host, &sandbox).await) }
        });
        if let Err(e) = hyper::server::conn::http1::Builder::new()
            .preserve_header_case(true)
            .serve_connection(TokioIo::new(guest), service)
            .await
        {
            tracing::debug!("a brokered connection: {e}");
        }
        Ok(())
    }

    /// One request of the guest's: to `host` only, with its secrets put in.
    async fn forward(
        &self,
        mut request: Request<Incoming>,
        sender: &tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Incoming>>,
        host: &str,
        sandbox: &str,
    ) -> Response<BoxBody<Bytes, hyper::Error>> {
        let named = request
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(host_of);
        if named.as_deref().is_some_and(|n| n != host) {
            return answer(
                StatusCode::MISDIRECTED_REQUEST,
                "sandpit: this connection is for another host\n",
            );
        }
        let mut used = put_in(request.headers_mut(), &self.secrets_for(host));
        used.extend(set_headers(request.headers_mut(), &self.headers_for(host)));
        used.dedup();
        if !used.is_empty() {
            let now = OffsetDateTime::now_utc();
            let mut last = self.last_used.lock().unwrap();
            for name in &used {
                tracing::info!(%sandbox, %host, secret = %name, "secret put in");
                last.insert(name.clone(), now);
            }
        }
        let mut sender = sender.lock().await;
        if sender.ready().await.is_err() {
            return answer(
                StatusCode::BAD_GATEWAY,
                "sandpit: the server closed the connection\n",
            );
        }
        match sender.send_request(request).await {
            Ok(response) => response.map(|b| b.boxed()),
            Err(e) => answer(
                StatusCode::BAD_GATEWAY,
                &format!("sandpit: the server's answer: {e}\n"),
            ),
        }
    }
}

/// A TLS connection to a secret's server.
pub type Server = tokio_rustls::client::TlsStream<TcpStream>;

/// The server of `host` at `target`, reached and verified for that name
/// with `client`, before the guest's handshake is answered; `Err` (the
/// reason to log) when it cannot be: the guest is then refused.
pub async fn reach(
    host: &str,
    target: SocketAddrV4,
    client: Arc<rustls::ClientConfig>,
) -> Result<Server, String> {
    let name = rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|_| format!("{host} (not a server name)"))?;
    tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let tcp = TcpStream::connect(target).await?;
        // Small TLS records each at once (a delayed ACK would hold one
        // back 40 ms).
        tcp.set_nodelay(true)?;
        tokio_rustls::TlsConnector::from(client)
            .connect(name, tcp)
            .await
    })
    .await
    .map_err(|_| format!("{host} (its server at {target} did not answer in time)"))?
    .map_err(|e| format!("{host} (its server at {target}: {e})"))
}

/// A `Host` header's name, without its port, in lower case.
fn host_of(value: &str) -> String {
    let name = match value.rsplit_once(':') {
        Some((n, port)) if port.bytes().all(|b| b.is_ascii_digit()) => n,
        _ => value,
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

fn answer(status: StatusCode, text: &str) -> Response<BoxBody<Bytes, hyper::Error>> {
    let mut response = Response::new(
        Full::new(Bytes::from(text.to_string()))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response
}

/// `secrets` put into `headers`: in each secret's own header, a value that
/// is the placeholder alone becomes the secret's format with the value; a
/// value holding it (`Bearer <placeholder>`) gets the value in its place,
/// and so does the user or password of a `Basic` one. Other headers are
/// left as they are. Returns the names of the secrets put in.
pub fn put_in(headers: &mut HeaderMap, secrets: &[&BrokeredSecret]) -> Vec<String> {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut used = Vec::new();
    for s in secrets {
        let Ok(name) = http::HeaderName::from_bytes(s.header.as_bytes()) else {
            continue;
        };
        let (ph, value) = (s.placeholder.as_str(), s.value.expose());
        let (mut replaced, mut changed) = (Vec::new(), false);
        for v in headers.get_all(&name) {
            let text = v.to_str().unwrap_or_default();
            let new = if text == ph {
                Some(s.format.replace("{value}", value))
            } else if text.contains(ph) {
                Some(text.replace(ph, value))
            } else if let Some(encoded) = text.strip_prefix("Basic ") {
                b64.decode(encoded.trim())
                    .ok()
                    .and_then(|d| String::from_utf8(d).ok())
                    .filter(|d| d.contains(ph))
                    .map(|d| format!("Basic {}", b64.encode(d.replace(ph, value))))
            } else {
                None
            };
            match new.map(|n| HeaderValue::from_str(&n)) {
                Some(Ok(mut n)) => {
                    n.set_sensitive(true);
                    replaced.push(n);
                    changed = true;
                }
                _ => replaced.push(v.clone()),
            }
        }
        if !changed {
            continue;
        }
        headers.remove(&name);
        for v in replaced {
            headers.append(name.clone(), v);
        }
        used.push(s.name.clone());
    }
    used
}

/// `rules` applied to `headers`: each rule's header set to its value, any
/// the guest sent of that name replaced (a later rule for the same header
/// wins). Returns the names of the secrets their values hold.
pub fn set_headers(headers: &mut HeaderMap, rules: &[&HeaderRule]) -> Vec<String> {
    let mut used = Vec::new();
    for rule in rules {
        let Ok(name) = http::HeaderName::from_bytes(rule.header.as_bytes()) else {
            continue;
        };
        let Ok(mut value) = HeaderValue::from_str(rule.value.expose()) else {
            continue;
        };
        value.set_sensitive(!rule.secrets.is_empty());
        headers.insert(name, value);
        for secret in &rule.secrets {
            if !used.contains(secret) {
                used.push(secret.clone());
            }
        }
    }
    used
}

/// What the host's egress path trusts when it reaches a secret's server:
/// the host's own trust store (`SSL_CERT_FILE` or the system's) and the
/// operator's `extra` CA certificates (PEM text), offering HTTP/1.1.
pub fn client_config(extra: &[String]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for e in &found.errors {
        tracing::warn!("the host's trust store: {e}");
    }
    roots.add_parsable_certificates(found.certs);
    for pem in extra {
        use rustls::pki_types::pem::PemObject;
        let certs = rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes()).flatten();
        roots.add_parsable_certificates(certs);
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("ring's defaults")
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

/// A stream whose first bytes were already read (the ClientHello the
/// proxy peeked at), given back before the rest.
struct Replay {
    first: Vec<u8>,
    at: usize,
    inner: TcpStream,
}

impl Replay {
    fn new(first: Vec<u8>, inner: TcpStream) -> Replay {
        Replay {
            first,
            at: 0,
            inner,
        }
    }
}

impl AsyncRead for Replay {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.at < self.first.len() {
            let n = buf.remaining().min(self.first.len() - self.at);
            let at = self.at;
            buf.put_slice(&self.first[at..at + n]);
            self.at += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Replay {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::broker::{BrokerCa, Sensitive};

    fn secret(header: &str, format: &str) -> BrokeredSecret {
        BrokeredSecret {
            name: "API_KEY".into(),
            placeholder: "sandpit-secret-0123456789abcdef0123456789abcdef01234567".into(),
            hosts: vec!["api.example.com".into(), "*.example.org".into()],
            header: header.into(),
            format: format.into(),
            value: Sensitive::new("sk-real-value"),
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn the_value_goes_where_the_placeholder_was_in_the_secrets_own_header_only() {
        let s = secret("Authorization", "Bearer {value}");
        let ph = s.placeholder.clone();
        // Bearer <placeholder>: the value in its place.
        let mut h = headers(&[("authorization", &format!("Bearer {ph}"))]);
        assert_eq!(put_in(&mut h, &[&s]), vec!["API_KEY"]);
        assert_eq!(h["authorization"], "Bearer sk-real-value");
        // The placeholder alone: the format.
        let mut h = headers(&[("Authorization", &ph)]);
        put_in(&mut h, &[&s]);
        assert_eq!(h["authorization"], "Bearer sk-real-value");
        // In another header: left as it was.
        let mut h = headers(&[("x-other", &ph), ("authorization", "Bearer mine")]);
        assert!(put_in(&mut h, &[&s]).is_empty());
        assert_eq!(h["x-other"], ph.as_str());
        assert_eq!(h["authorization"], "Bearer mine");
        // Basic: user or password.
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        let basic = format!("Basic {}", b64.encode(format!("x-access-token:{ph}")));
        let mut h = headers(&[("authorization", &basic)]);
        put_in(&mut h, &[&s]);
        assert_eq!(
            h["authorization"],
            format!("Basic {}", b64.encode("x-access-token:sk-real-value")).as_str()
        );
        // x-api-key with `{value}`.
        let s = secret("x-api-key", "{value}");
        let mut h = headers(&[("X-Api-Key", &ph)]);
        put_in(&mut h, &[&s]);
        assert_eq!(h["x-api-key"], "sk-real-value");
        assert!(h["x-api-key"].is_sensitive());
    }

    #[test]
    fn a_broker_matches_its_secrets_hosts_and_none_without_values() {
        let broker = Broker {
            ca: BrokerCa::generate("sbx_test").unwrap(),
            secrets: vec![secret("Authorization", "Bearer {value}")],
            headers: vec![],
        };
        let path = BrokerPath::new(&broker).expect("usable");
        assert_eq!(path.secrets_for("api.example.com").len(), 1);
        assert_eq!(path.secrets_for("eu.example.org").len(), 1);
        assert!(path.secrets_for("example.org").is_empty());
        assert!(path.secrets_for("api.example.com.evil.test").is_empty());
        // A certificate for a host, signed by the sandbox's CA, made once.
        let a = path.server_config("api.example.com").unwrap();
        let b = path.server_config("api.example.com").unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        // As a VM's record holds it: nothing to broker.
        assert!(BrokerPath::new(&broker.without_values()).is_none());
        let on_disk = serde_json::to_string(&broker.without_values()).unwrap();
        assert!(!on_disk.contains("sk-real-value"));
        assert!(!on_disk.contains("PRIVATE KEY"));
        assert_eq!(format!("{:?}", broker).matches("sk-real-value").count(), 0);
    }

    fn header_rule(hosts: &[&str], header: &str, value: &str) -> HeaderRule {
        HeaderRule {
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            header: header.into(),
            value: Sensitive::new(value),
            secrets: vec!["my-key".into()],
        }
    }

    #[test]
    fn a_header_rule_sets_its_header_replacing_the_guests() {
        let auth = header_rule(&["api.example.com"], "Authorization", "Bearer sk-real");
        let extra = header_rule(&["api.example.com"], "X-Team", "a");
        // The guest's own of that name replaced, every copy; others kept.
        let mut h = headers(&[
            ("authorization", "Bearer mine"),
            ("Authorization", "Basic other"),
            ("accept", "*/*"),
        ]);
        assert_eq!(set_headers(&mut h, &[&auth, &extra]), vec!["my-key"]);
        assert_eq!(h.get_all("authorization").iter().count(), 1);
        assert_eq!(h["authorization"], "Bearer sk-real");
        assert!(h["authorization"].is_sensitive());
        assert_eq!(h["x-team"], "a");
        assert_eq!(h["accept"], "*/*");
        // None sent: set all the same.
        let mut h = HeaderMap::new();
        set_headers(&mut h, &[&auth]);
        assert_eq!(h["authorization"], "Bearer sk-real");
        // A later rule for the same header wins.
        let later = header_rule(&["api.example.com"], "authorization", "Bearer later");
        let mut h = HeaderMap::new();
        set_headers(&mut h, &[&auth, &later]);
        assert_eq!(h["authorization"], "Bearer later");
    }

    #[test]
    fn a_broker_with_header_rules_alone_ends_tls_for_their_hosts_only() {
        let broker = Broker {
            ca: BrokerCa::generate("sbx_test").unwrap(),
            secrets: vec![],
            headers: vec![header_rule(
                &["api.example.com", "*.example.net"],
                "Authorization",
                "Bearer sk-real",
            )],
        }
        .checked()
        .unwrap();
        let path = BrokerPath::new(&broker).expect("usable");
        assert!(path.brokers_for("api.example.com"));
        assert!(path.brokers_for("eu.example.net"));
        assert!(!path.brokers_for("example.com"));
        assert!(path.secrets_for("api.example.com").is_empty());
        assert_eq!(path.headers_for("api.example.com").len(), 1);
        // As a VM's record holds it: no value, nothing to broker.
        let on_disk = broker.without_values();
        assert!(BrokerPath::new(&on_disk).is_none());
        assert!(!serde_json::to_string(&on_disk).unwrap().contains("sk-real"));
        assert!(!format!("{broker:?}").contains("sk-real"));
        // A value no header may hold is refused.
        let mut bad = broker.clone();
        bad.headers[0].value = Sensitive::new("a\nb");
        assert!(bad.checked().is_err());
    }

    #[test]
    fn a_host_header_is_compared_without_port_case_or_final_dot() {
        assert_eq!(host_of("API.Example.com:443"), "api.example.com");
        assert_eq!(host_of("api.example.com."), "api.example.com");
        assert_eq!(host_of("api.example.com"), "api.example.com");
    }
}
