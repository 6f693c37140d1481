//! A sandbox's egress by name: the rules of its lists that name hosts
//! (`example.com`, `*.example.com`) rather than addresses, and the first
//! look at a connection that tells which host it is for.
//!
//! Why by name and not by the addresses a name had once: a name's addresses
//! change, and one address serves many names (a CDN). So the host looks at
//! what the guest itself says it wants, before anything is connected on
//! its behalf: the server name of a TLS ClientHello (SNI), or the `Host` of
//! an HTTP request. A connection that names nothing the rules allow is
//! refused; one that names an allowed host reaches only the address the
//! guest asked for, which the host's guard has vetted like any other
//! (the operator's deny list, the host's own addresses).
//!
//! The parts: what decides ([`names`], [`peek`], [`rules`]), the proxy
//! that applies it to a VM's connections ([`proxy`]) and to its lookups
//! ([`dns`]), and the secrets it brokers ([`broker`], [`terminate`]).

pub mod broker;
pub mod dns;
pub mod names;
pub mod peek;
pub mod proxy;
pub mod rules;
pub mod terminate;
