//! The first look at a guest's connection: which host it names, from the
//! bytes the guest sent first (nothing is answered, nothing is connected
//! yet). A TLS ClientHello's server name (SNI), read by rustls' own
//! parser; an HTTP/1 request's `Host`, read by httparse. The bytes are
//! only read: the proxy sends them on as they came.

use rustls::server::Acceptor;

/// At most this much is read before deciding (a ClientHello with many
/// extensions, post-quantum key shares included, stays well within it).
pub const MAX_PEEK: usize = 16 * 1024;

/// What the first bytes of a connection say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peeked {
    /// Too few bytes yet to tell: read more (up to [`MAX_PEEK`]).
    NeedMore,
    /// A TLS ClientHello, and the server name it asks for, if any.
    Tls { server_name: Option<String> },
    /// An HTTP/1 request, and its `Host` without the port, if it has one
    /// (a request with two is refused: a name each to two readers).
    Http { host: Option<String> },
    /// Neither, or malformed: a connection that names no host.
    Unnamed,
}

impl Peeked {
    /// The host it names, if any.
    pub fn name(&self) -> Option<&str> {
        match self {
            Peeked::Tls { server_name } => server_name.as_deref(),
            Peeked::Http { host } => host.as_deref(),
            Peeked::NeedMore | Peeked::Unnamed => None,
        }
    }
}

/// What `first` (the bytes a connection began with) names.
pub fn peek(first: &[u8]) -> Peeked {
    match first.first() {
        None => Peeked::NeedMore,
        // A TLS record of type handshake.
        Some(0x16) => tls(first),
        Some(_) => http(first),
    }
}

fn tls(first: &[u8]) -> Peeked {
    let mut acceptor = Acceptor::default();
    let mut bytes = first;
    while !bytes.is_empty() {
        match acceptor.read_tls(&mut bytes) {
            Ok(0) => break,
            Ok(_) => {}
            Err(_) => return Peeked::Unnamed,
        }
    }
    match acceptor.accept() {
        Ok(Some(accepted)) => Peeked::Tls {
            server_name: accepted.client_hello().server_name().map(str::to_string),
        },
        Ok(None) if first.len() < MAX_PEEK => Peeked::NeedMore,
        Ok(None) | Err(_) => Peeked::Unnamed,
    }
}

fn http(first: &[u8]) -> Peeked {
    let mut headers = [httparse::EMPTY_HEADER; 100];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(first) {
        Ok(httparse::Status::Partial) if first.len() < MAX_PEEK => Peeked::NeedMore,
        Ok(httparse::Status::Partial) | Err(_) => Peeked::Unnamed,
        Ok(httparse::Status::Complete(_)) => {
            // CONNECT names its host in the target, not for this proxy to
            // follow: the connection is to the address the guest dialled.
            if req.method == Some("CONNECT") {
                return Peeked::Unnamed;
            }
            let hosts: Vec<&[u8]> = req
                .headers
                .iter()
                .filter(|h| h.name.eq_ignore_ascii_case("host"))
                .map(|h| h.value)
                .collect();
            let host = match hosts.as_slice() {
                [one] => std::str::from_utf8(one).ok().and_then(without_port),
                _ => None,
            };
            Peeked::Http { host }
        }
    }
}

/// `host[:port]` (or `[v6]:port`) without its port.
fn without_port(value: &str) -> Option<String> {
    let value = value.trim();
    if let Some(rest) = value.strip_prefix('[') {
        return rest.split_once(']').map(|(addr, _)| addr.to_string());
    }
    let host = match value.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => value,
    };
    (!host.is_empty()).then(|| host.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real ClientHello for `name`, as rustls' client writes it.
    fn client_hello(name: &str) -> Vec<u8> {
        let mut roots = rustls::RootCertStore::empty();
        roots.roots.clear();
        let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let server_name = rustls::pki_types::ServerName::try_from(name.to_string()).unwrap();
        let mut conn =
            rustls::ClientConnection::new(std::sync::Arc::new(config), server_name).unwrap();
        let mut out = Vec::new();
        conn.write_tls(&mut out).unwrap();
        out
    }

    #[test]
    fn a_client_hello_names_its_server_whole_or_in_pieces() {
        let hello = client_hello("api.example.com");
        assert_eq!(
            peek(&hello),
            Peeked::Tls {
                server_name: Some("api.example.com".into())
            }
        );
        assert_eq!(peek(&hello[..5]), Peeked::NeedMore);
        assert_eq!(peek(&hello[..hello.len() - 1]), Peeked::NeedMore);
        // An address names no server (SNI carries names only).
        assert_eq!(
            peek(&client_hello("198.51.100.7")),
            Peeked::Tls { server_name: None }
        );
    }

    #[test]
    fn garbage_after_a_handshake_byte_names_nothing() {
        let mut junk = vec![0x16, 0x03, 0x01, 0x00, 0x05];
        junk.extend_from_slice(&[0xff; 5]);
        assert_eq!(peek(&junk), Peeked::Unnamed);
        // A record that claims to be longer than anything sent, forever.
        let mut long = vec![0x16, 0x03, 0x01, 0xff, 0xff];
        long.resize(MAX_PEEK, 0);
        assert_eq!(peek(&long), Peeked::Unnamed);
    }

    #[test]
    fn an_http_request_names_its_host() {
        let req = b"GET /x HTTP/1.1\r\nHost: Web.Example.com:8080\r\nAccept: */*\r\n\r\n";
        assert_eq!(
            peek(req),
            Peeked::Http {
                host: Some("Web.Example.com".into())
            }
        );
        assert_eq!(peek(&req[..20]), Peeked::NeedMore);
        let v6 = b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n";
        assert_eq!(
            peek(v6),
            Peeked::Http {
                host: Some("::1".into())
            }
        );
        let none = b"GET / HTTP/1.0\r\n\r\n";
        assert_eq!(peek(none), Peeked::Http { host: None });
        let two = b"GET / HTTP/1.1\r\nHost: a.example\r\nhost: b.example\r\n\r\n";
        assert_eq!(peek(two), Peeked::Http { host: None });
        let connect = b"CONNECT secret.example:443 HTTP/1.1\r\nHost: allowed.example\r\n\r\n";
        assert_eq!(peek(connect), Peeked::Unnamed);
        assert_eq!(peek(b"\x00\x01binary"), Peeked::Unnamed);
        let endless = [b"GET / HTTP/1.1\r\nX: ".as_slice(), &[b'a'; MAX_PEEK]].concat();
        assert_eq!(peek(&endless), Peeked::Unnamed);
    }
}
