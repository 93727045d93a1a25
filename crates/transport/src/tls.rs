//! Mutually authenticated TLS for the transfer channel (K14).
//!
//! Every node holds a certificate signed by the operator's CA and trusts
//! only that CA: an accepting node demands a client certificate chaining to
//! it, a dialling node checks the server's certificate chains to it *and*
//! names [`TlsSettings::server_name`] (one name every node's certificate
//! carries, since pod addresses change). TLS 1.3 only, `ring` provider.
//! A peer that fails any of this is refused during the handshake — before
//! a byte of the protocol is read — and counted.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// The name every node certificate carries (a DNS subject alternative
/// name) unless the operator chooses another (`--transfer-tls-server-name`).
pub const DEFAULT_SERVER_NAME: &str = "isoserve-transfer";

/// Why TLS material could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}: {err}")]
    Read {
        what: &'static str,
        path: PathBuf,
        err: std::io::Error,
    },
    #[error("{what}: {why}")]
    Pem { what: &'static str, why: String },
    #[error("{what} holds no {kind}")]
    Empty {
        what: &'static str,
        kind: &'static str,
    },
    #[error("invalid server name `{0}` (a DNS name the certificates carry)")]
    ServerName(String),
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// Where a node's TLS material is, as the operator gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsSettings {
    /// This node's certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA certificate(s) peers' certificates must chain to (PEM).
    pub ca: PathBuf,
    /// The DNS name a dialled node's certificate must carry.
    pub server_name: String,
}

/// Ready-to-use TLS for a transport: an acceptor that demands client
/// certificates from the CA and a connector that presents this node's.
#[derive(Clone)]
pub struct TransportTls {
    pub(crate) acceptor: TlsAcceptor,
    pub(crate) connector: TlsConnector,
    pub(crate) server_name: ServerName<'static>,
}

impl std::fmt::Debug for TransportTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|err| TlsError::Read {
        what,
        path: path.to_path_buf(),
        err,
    })
}

fn certs(what: &'static str, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            what,
            why: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            what,
            kind: "PEM certificate",
        });
    }
    Ok(certs)
}

/// rustls' `ring` provider: X25519/P-256 key exchange, AES-GCM and
/// ChaCha20-Poly1305. rustls deprecates it in favour of aws-lc-rs, whose
/// post-quantum hybrid key exchange needs the aws-lc C build (minutes of
/// every clean CI build on two cores); moving to it is a feature switch
/// here and in `Cargo.toml`, not a code change.
/// This node's certificate chain and private key from PEM.
fn identity(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    let chain = certs("certificate", cert_pem)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError::Pem {
        what: "private key",
        why: e.to_string(),
    })?;
    Ok((chain, key))
}

#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl TransportTls {
    /// Loads the files named in `s`.
    pub fn load(s: &TlsSettings) -> Result<TransportTls, TlsError> {
        TransportTls::from_pem(
            &read("certificate", &s.cert)?,
            &read("private key", &s.key)?,
            &read("CA certificate", &s.ca)?,
            &s.server_name,
        )
    }

    /// From PEM bytes: this node's chain and key, the CA, the name dialled
    /// nodes' certificates must carry.
    pub fn from_pem(
        cert_pem: &[u8],
        key_pem: &[u8],
        ca_pem: &[u8],
        server_name: &str,
    ) -> Result<TransportTls, TlsError> {
        let (chain, key) = identity(cert_pem, key_pem)?;
        let mut roots = RootCertStore::empty();
        for ca in certs("CA certificate", ca_pem)? {
            roots
                .add(ca)
                .map_err(|e| TlsError::Config(format!("CA certificate: {e}")))?;
        }
        let roots = Arc::new(roots);
        let config_err = |e: rustls::Error| TlsError::Config(e.to_string());
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let server = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(config_err)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(config_err)?;
        let client = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(config_err)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(config_err)?;
        let server_name = ServerName::try_from(server_name.to_string())
            .map_err(|_| TlsError::ServerName(server_name.to_string()))?;
        Ok(TransportTls {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            connector: TlsConnector::from(Arc::new(client)),
            server_name,
        })
    }

    /// The same node, but accepting any peer that completes a TLS handshake
    /// without a client certificate: the check removed. For the tests that
    /// show removing it is caught; never built from operator flags.
    #[doc(hidden)]
    pub fn without_client_auth_for_tests(
        cert_pem: &[u8],
        key_pem: &[u8],
        ca_pem: &[u8],
        server_name: &str,
    ) -> Result<TransportTls, TlsError> {
        let mut t = TransportTls::from_pem(cert_pem, key_pem, ca_pem, server_name)?;
        let (chain, key) = identity(cert_pem, key_pem)?;
        let server = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| TlsError::Config(e.to_string()))?;
        t.acceptor = TlsAcceptor::from(Arc::new(server));
        Ok(t)
    }
}
