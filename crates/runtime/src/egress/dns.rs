//! A sandbox's name lookups, answered as its lists would decide the
//! connections that follow them. When a sandbox's lists name hosts, the
//! host redirects its guest's DNS (UDP and TCP port 53, to any server) to
//! its egress proxy's port (see `vm::guard`), which asks the guests' own
//! name servers ([`Upstream::name_servers`](super::proxy::Upstream)) and
//! filters what they say:
//!
//! - a name refused whatever its addresses (a denied name; with an allow
//!   list that names hosts and denies everything else, any name it does
//!   not allow) gets NXDOMAIN at once, and is never asked upstream: a
//!   guest cannot carry data out in the names it looks up;
//! - else the name is asked, and each IPv4 address of the answer is kept
//!   only if a connection to it under that name would be let through; an
//!   answer left with none becomes NXDOMAIN.
//!
//! Either refusal is counted and logged with the rule, like a refused
//! connection. The proxy still decides every connection by the name it
//! carries: DNS filtering makes a refusal fail at once with a clear error
//! (curl's "could not resolve host"), it is not what enforces the lists.
//!
//! Why not forward to the server the guest asked: for UDP the redirect
//! leaves no record of it that a socket can read, and the guests' own
//! servers are the ones the operator configured.

use super::rules::Rules;
use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{RData, RecordType};
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

/// The largest DNS message over UDP taken or given (EDNS' common limit).
pub const MAX_UDP_MESSAGE: usize = 4096;
/// How long one name server may take to answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(3);

/// What becomes of a query.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Asked upstream, its answer then [`filter_answer`]ed for `name`.
    Ask { name: String },
    /// Answered here (NXDOMAIN, or FORMERR for what is not a query); the
    /// rule that refused it when one did.
    Answer {
        message: Vec<u8>,
        rule: Option<String>,
    },
}

/// What `rules` make of the DNS message `query`.
pub fn verdict(rules: &Rules, query: &[u8]) -> Verdict {
    let Ok(message) = Message::from_vec(query) else {
        return formerr(query);
    };
    if message.message_type() != MessageType::Query || message.queries().len() != 1 {
        return formerr(query);
    }
    let name = query_name(&message);
    match rules.refuses_name(&name) {
        Some(rule) => Verdict::Answer {
            message: nxdomain(&message),
            rule: Some(rule),
        },
        None => Verdict::Ask { name },
    }
}

/// `answer` (a name server's, to a query for `name`) with the IPv4
/// addresses `rules` would not let a connection reach under that name left
/// out; NXDOMAIN when none is left, with the rule that refused the last.
/// An answer that does not parse becomes SERVFAIL: what it holds cannot
/// be checked.
pub fn filter_answer(rules: &Rules, name: &str, answer: &[u8]) -> (Vec<u8>, Option<String>) {
    let Ok(mut message) = Message::from_vec(answer) else {
        let id = answer
            .get(..2)
            .map_or(0, |b| u16::from_be_bytes([b[0], b[1]]));
        let failed = Message::error_msg(id, OpCode::Query, ResponseCode::ServFail);
        return (failed.to_vec().unwrap_or_default(), None);
    };
    let records = message.take_answers();
    let addresses = records
        .iter()
        .filter(|r| r.record_type() == RecordType::A)
        .count();
    let mut refused_by = None;
    let kept: Vec<_> = records
        .into_iter()
        .filter(|r| match r.data() {
            Some(RData::A(a)) => match rules.refuses_address(name, a.0) {
                Some(rule) => {
                    refused_by = Some(rule);
                    false
                }
                None => true,
            },
            _ => true,
        })
        .collect();
    let left = kept
        .iter()
        .filter(|r| r.record_type() == RecordType::A)
        .count();
    if addresses > 0 && left == 0 {
        return (nxdomain(&message), refused_by);
    }
    message.insert_answers(kept);
    match message.to_vec() {
        Ok(bytes) if refused_by.is_some() => (bytes, refused_by),
        // Nothing left out: the name server's own bytes.
        Ok(_) => (answer.to_vec(), None),
        Err(_) => (answer.to_vec(), None),
    }
}

/// Ask the name servers `servers` in turn over UDP; the first answer with
/// the query's id.
pub async fn ask_udp(servers: &[SocketAddr], query: &[u8]) -> io::Result<Vec<u8>> {
    let mut last = io::Error::other("no name server is configured");
    for server in servers {
        match tokio::time::timeout(ANSWER_TIMEOUT, ask_one_udp(*server, query)).await {
            Ok(Ok(answer)) => return Ok(answer),
            Ok(Err(e)) => last = e,
            Err(_) => last = io::Error::new(io::ErrorKind::TimedOut, format!("{server} timed out")),
        }
    }
    Err(last)
}

async fn ask_one_udp(server: SocketAddr, query: &[u8]) -> io::Result<Vec<u8>> {
    let socket = tokio::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await?;
    socket.connect(server).await?;
    socket.send(query).await?;
    let mut buf = vec![0u8; MAX_UDP_MESSAGE];
    loop {
        let n = socket.recv(&mut buf).await?;
        if n >= 2 && buf[..2] == query[..2] {
            buf.truncate(n);
            return Ok(buf);
        }
    }
}

/// Ask the name servers `servers` in turn over TCP (a truncated answer's
/// second try).
pub async fn ask_tcp(servers: &[SocketAddr], query: &[u8]) -> io::Result<Vec<u8>> {
    let mut last = io::Error::other("no name server is configured");
    for server in servers {
        match tokio::time::timeout(ANSWER_TIMEOUT, ask_one_tcp(*server, query)).await {
            Ok(Ok(answer)) => return Ok(answer),
            Ok(Err(e)) => last = e,
            Err(_) => last = io::Error::new(io::ErrorKind::TimedOut, format!("{server} timed out")),
        }
    }
    Err(last)
}

async fn ask_one_tcp(server: SocketAddr, query: &[u8]) -> io::Result<Vec<u8>> {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(server).await?;
    let length = u16::try_from(query.len()).map_err(io::Error::other)?;
    let mut framed = length.to_be_bytes().to_vec();
    framed.extend_from_slice(query);
    stream.write_all(&framed).await?;
    read_framed(&mut stream)
        .await?
        .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "no answer"))
}

/// One length-prefixed DNS message from a TCP stream; `None` at its end.
pub async fn read_framed<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
) -> io::Result<Option<Vec<u8>>> {
    use tokio::io::AsyncReadExt;
    let mut length = [0u8; 2];
    match r.read_exact(&mut length).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut message = vec![0u8; u16::from_be_bytes(length) as usize];
    r.read_exact(&mut message).await?;
    Ok(Some(message))
}

/// The name a query asks about, lower case, without its trailing dot.
fn query_name(message: &Message) -> String {
    let name = message.queries()[0].name().to_ascii();
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// "No such name", in answer to `query`.
fn nxdomain(query: &Message) -> Vec<u8> {
    let mut answer = Message::new();
    answer
        .set_id(query.id())
        .set_message_type(MessageType::Response)
        .set_op_code(query.op_code())
        .set_recursion_desired(query.recursion_desired())
        .set_recursion_available(true)
        .set_response_code(ResponseCode::NXDomain);
    answer.add_queries(query.queries().to_vec());
    answer.to_vec().unwrap_or_default()
}

/// "Format error", in answer to what did not parse as one query.
fn formerr(query: &[u8]) -> Verdict {
    let id = query
        .get(..2)
        .map_or(0, |b| u16::from_be_bytes([b[0], b[1]]));
    let answer = Message::error_msg(id, OpCode::Query, ResponseCode::FormErr);
    Verdict::Answer {
        message: answer.to_vec().unwrap_or_default(),
        rule: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Query;
    use hickory_proto::rr::{rdata, Name, Record};
    use std::str::FromStr;

    fn rules(allow: &[&str], deny: &[&str]) -> Rules {
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        Rules::new(&v(allow), &v(deny)).unwrap()
    }

    fn query(name: &str, kind: RecordType) -> Message {
        let mut q = Message::new();
        q.set_id(0x4242).set_recursion_desired(true);
        q.add_query(Query::query(Name::from_str(name).unwrap(), kind));
        q
    }

    fn answer(name: &str, addresses: &[[u8; 4]]) -> Vec<u8> {
        let mut a = query(name, RecordType::A);
        a.set_message_type(MessageType::Response);
        for octets in addresses {
            a.add_answer(Record::from_rdata(
                Name::from_str(name).unwrap(),
                60,
                RData::A(rdata::A(Ipv4Addr::from(*octets))),
            ));
        }
        a.to_vec().unwrap()
    }

    fn addresses(bytes: &[u8]) -> (ResponseCode, Vec<Ipv4Addr>) {
        let m = Message::from_vec(bytes).unwrap();
        let found = m
            .answers()
            .iter()
            .filter_map(|r| match r.data() {
                Some(RData::A(a)) => Some(a.0),
                _ => None,
            })
            .collect();
        (m.response_code(), found)
    }

    #[test]
    fn with_an_allow_list_of_names_only_those_names_are_asked() {
        let r = rules(&["web.test", "*.pypi.test"], &["0.0.0.0/0"]);
        let ask = |name: &str| verdict(&r, &query(name, RecordType::A).to_vec().unwrap());
        assert_eq!(
            ask("Web.Test."),
            Verdict::Ask {
                name: "web.test".into()
            }
        );
        assert_eq!(
            ask("files.pypi.test."),
            Verdict::Ask {
                name: "files.pypi.test".into()
            }
        );
        let Verdict::Answer { message, rule } = ask("other.test.") else {
            panic!("other.test was asked upstream");
        };
        assert_eq!(rule.as_deref(), Some("0.0.0.0/0"));
        let m = Message::from_vec(&message).unwrap();
        assert_eq!(m.id(), 0x4242);
        assert_eq!(m.response_code(), ResponseCode::NXDomain);
        assert_eq!(m.queries()[0].name().to_ascii(), "other.test.");
        // Any type of record, so no name carries data out.
        let txt = verdict(
            &r,
            &query("c2VjcmV0.exfil.test.", RecordType::TXT)
                .to_vec()
                .unwrap(),
        );
        assert!(matches!(txt, Verdict::Answer { rule: Some(_), .. }));
    }

    #[test]
    fn a_denied_name_is_refused_and_others_asked() {
        let r = rules(&[], &["*.tracker.test"]);
        let q = |name: &str| query(name, RecordType::A).to_vec().unwrap();
        assert!(matches!(
            verdict(&r, &q("a.tracker.test.")),
            Verdict::Answer { rule: Some(rule), .. } if rule == "*.tracker.test"
        ));
        assert_eq!(
            verdict(&r, &q("fine.test.")),
            Verdict::Ask {
                name: "fine.test".into()
            }
        );
        // An allowed prefix may still let the name's addresses through.
        let r = rules(&["198.51.100.0/24"], &["0.0.0.0/0", "*.tracker.test"]);
        assert!(matches!(
            verdict(&r, &q("a.tracker.test.")),
            Verdict::Ask { .. }
        ));
    }

    #[test]
    fn an_answer_keeps_only_the_addresses_the_lists_let_through() {
        let r = rules(&["198.51.100.0/24", "named.test"], &["0.0.0.0/0"]);
        let mixed = answer("mixed.test.", &[[198, 51, 100, 7], [203, 0, 113, 9]]);
        let (bytes, rule) = filter_answer(&r, "mixed.test", &mixed);
        assert_eq!(rule.as_deref(), Some("0.0.0.0/0"));
        assert_eq!(
            addresses(&bytes),
            (ResponseCode::NoError, vec![Ipv4Addr::new(198, 51, 100, 7)])
        );
        let outside = answer("outside.test.", &[[203, 0, 113, 9]]);
        let (bytes, rule) = filter_answer(&r, "outside.test", &outside);
        assert!(rule.is_some());
        assert_eq!(addresses(&bytes), (ResponseCode::NXDomain, vec![]));
        // An allowed name keeps all of its addresses, byte for byte.
        let named = answer("named.test.", &[[203, 0, 113, 9]]);
        assert_eq!(
            filter_answer(&r, "named.test", &named),
            (named.clone(), None)
        );
    }

    #[test]
    fn what_is_not_one_query_or_not_an_answer_is_not_passed_on() {
        let r = rules(&["web.test"], &["0.0.0.0/0"]);
        for junk in [&b"\x12\x34"[..], b"", &[0xff; 40]] {
            let Verdict::Answer {
                message,
                rule: None,
            } = verdict(&r, junk)
            else {
                panic!("{junk:?} was asked upstream");
            };
            assert_eq!(
                Message::from_vec(&message).unwrap().response_code(),
                ResponseCode::FormErr
            );
        }
        let (bytes, _) = filter_answer(&r, "web.test", b"\x12\x34\x81");
        assert_eq!(
            Message::from_vec(&bytes).unwrap().response_code(),
            ResponseCode::ServFail
        );
    }
}
