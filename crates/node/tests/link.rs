//! The control plane ↔ node link over real TCP on the loopback: a cluster CA
//! made by `init_ca`, members' certificates from `issue`, a node API server
//! and clients with and without the cluster's certificates.

use sandpit_node::{
    api, client_config, init_ca, issue, server_config, Health, NodeClient, NodeError, NodeState,
};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio_rustls::rustls;

/// A node whose epoch the test sets (0 = fenced), counting what it served.
struct TestNode {
    epoch: AtomicI64,
    asked: AtomicUsize,
}

impl NodeState for TestNode {
    fn name(&self) -> &str {
        "n1"
    }
    fn epoch(&self) -> Option<i64> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        match self.epoch.load(Ordering::SeqCst) {
            0 => None,
            e => Some(e),
        }
    }
    fn exec(
        &self,
        id: String,
        _request: sandpit_protocol::ExecRequest,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = Result<sandpit_runtime::ExecHandle, sandpit_node::Refusal>,
                > + Send
                + '_,
        >,
    > {
        // This test node has no VMs (the cluster test runs real ones).
        Box::pin(async move {
            Err(sandpit_node::Refusal {
                status: 404,
                kind: "not_found".into(),
                message: format!("sandbox {id} not found"),
            })
        })
    }
}

#[tokio::test]
async fn only_members_of_the_cluster_reach_a_node_and_only_at_its_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("cluster");
    init_ca(&ca).unwrap();
    // A second init would replace the CA every member trusts: refused.
    let again = init_ca(&ca).unwrap_err().to_string();
    assert!(again.contains("already holds a cluster CA"), "{again}");
    let node = issue(&ca, "n1", &["127.0.0.1".into()]).unwrap();
    let replica = issue(&ca, "replica-a", &[]).unwrap();
    assert!(issue(&ca, "../evil", &[]).is_err());
    {
        use std::os::unix::fs::PermissionsExt;
        for key in [ca.join("ca.key"), node.key.clone(), replica.key.clone()] {
            let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", key.display());
        }
    }

    let state = Arc::new(TestNode {
        epoch: AtomicI64::new(7),
        asked: AtomicUsize::new(0),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(api::serve(
        listener,
        server_config(&node).unwrap(),
        state.clone(),
        async {
            let _ = stopped.await;
        },
    ));

    // A member, at the node's epoch.
    let member = NodeClient::new(client_config(&replica).unwrap());
    assert_eq!(
        member.health(&address, 7).await.unwrap(),
        Health {
            name: "n1".into(),
            epoch: 7
        }
    );
    // At an older epoch (the node started again since): refused.
    match member.health(&address, 6).await {
        Err(NodeError::StaleEpoch(m)) => assert!(m.contains("epoch 7"), "{m}"),
        other => panic!("{other:?}"),
    }

    let served = state.asked.load(Ordering::SeqCst);
    // No certificate at all: the handshake fails, nothing is served.
    let roots = {
        let mut r = rustls::RootCertStore::empty();
        use rustls::pki_types::pem::PemObject;
        for c in rustls::pki_types::CertificateDer::pem_file_iter(&node.ca).unwrap() {
            r.add(c.unwrap()).unwrap();
        }
        Arc::new(r)
    };
    let mut anonymous = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots.clone())
    .with_no_client_auth();
    anonymous.alpn_protocols = vec![b"h2".to_vec()];
    let anonymous = NodeClient::new(Arc::new(anonymous));
    assert!(matches!(
        anonymous.health(&address, 7).await,
        Err(NodeError::Unreachable { .. })
    ));
    // A certificate of another CA (another cluster, or self-made): refused.
    let other = dir.path().join("other");
    init_ca(&other).unwrap();
    let stranger = issue(&other, "replica-a", &[]).unwrap();
    let foreign = {
        use rustls::pki_types::pem::PemObject;
        let chain = rustls::pki_types::CertificateDer::pem_file_iter(&stranger.cert)
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&stranger.key).unwrap();
        // It trusts the node (the cluster's CA) but shows its own.
        let mut c = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
        c.alpn_protocols = vec![b"h2".to_vec()];
        NodeClient::new(Arc::new(c))
    };
    assert!(matches!(
        foreign.health(&address, 7).await,
        Err(NodeError::Unreachable { .. })
    ));
    // A member that does not trust this node's CA does not talk to it.
    let wary = NodeClient::new(client_config(&stranger).unwrap());
    assert!(matches!(
        wary.health(&address, 7).await,
        Err(NodeError::Unreachable { .. })
    ));
    assert_eq!(
        state.asked.load(Ordering::SeqCst),
        served,
        "the node served a peer outside the cluster"
    );

    // Fenced: nothing is served, whatever the epoch.
    state.epoch.store(0, Ordering::SeqCst);
    assert!(matches!(
        member.health(&address, 7).await,
        Err(NodeError::Fenced(_))
    ));
    // Joined again under a new epoch: calls for it are served.
    state.epoch.store(8, Ordering::SeqCst);
    assert_eq!(member.health(&address, 8).await.unwrap().epoch, 8);

    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}
