//! The webhook's certificate and its TLS server; also the TLS of filter and prioritize where
//! the extender runs behind a Service ([`verbs_server_config`]: a mounted certificate and, for
//! mutual TLS, the CA of kube-scheduler's client certificate).
//!
//! Two sources of the certificate:
//!
//! - **its own** (`--webhook-secret NS/NAME`): the first replica to start makes a CA and a
//!   serving certificate for the Service's DNS names (rcgen, ECDSA P-256, valid until the
//!   Secret is deleted: rcgen's default validity runs to the year 4096) and keeps
//!   them in one Secret, which every other replica reads (a replica that loses the race to
//!   create it reads the winner's), so that one CA bundle verifies every replica. It then
//!   publishes the CA in the MutatingWebhookConfiguration's `caBundle` (`--webhook-configuration`),
//!   and checks it again every 30 s (an install that replaced the configuration is mended).
//! - **cert-manager's** (`--webhook-cert-dir`): `tls.crt` and `tls.key` of the mounted Secret,
//!   read again when they change (cert-manager renews them), the CA injected by cert-manager.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams, PostParams};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_util::sync::CancellationToken;

/// Why the webhook has no certificate.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The certificate could not be made.
    #[error("cannot make the webhook's certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// A file of the certificate directory.
    #[error("cannot read {path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The Secret holds something that is not a certificate and its key.
    #[error("the Secret {0} does not hold a usable tls.crt and tls.key: {1}")]
    BadSecret(String, String),
    /// The API server refused or could not be reached.
    #[error("the Secret {0}: {1}")]
    Api(String, kube::Error),
    /// rustls refused the configuration.
    #[error("the TLS configuration: {0}")]
    Config(String),
}

/// The certificate a Secret holds (or is to hold): PEM texts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Material {
    /// The serving certificate.
    pub cert_pem: String,
    /// Its key.
    pub key_pem: String,
    /// The CA that signed it (the webhook configuration's `caBundle`).
    pub ca_pem: String,
}

impl Material {
    /// A new CA and a serving certificate for `dns_names`, signed by it.
    pub fn generate(dns_names: &[String]) -> Result<Self, TlsError> {
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca_params.distinguished_name.push(rcgen::DnType::CommonName, "baleen webhook CA");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
        ca_params.key_usages =
            vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
        let ca_key = rcgen::KeyPair::generate()?;
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key)?;
        let mut params = rcgen::CertificateParams::new(dns_names.to_vec())?;
        params.distinguished_name.push(
            rcgen::DnType::CommonName,
            dns_names.first().cloned().unwrap_or_else(|| "baleen-extender".into()),
        );
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let key = rcgen::KeyPair::generate()?;
        let cert = params.signed_by(&key, &ca)?;
        Ok(Self { cert_pem: cert.pem(), key_pem: key.serialize_pem(), ca_pem: ca.pem() })
    }

    /// The Secret's data.
    fn data(&self) -> BTreeMap<String, ByteString> {
        [("tls.crt", &self.cert_pem), ("tls.key", &self.key_pem), ("ca.crt", &self.ca_pem)]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), ByteString(v.clone().into_bytes())))
            .collect()
    }

    /// What a Secret holds.
    fn of(secret: &Secret, name: &str) -> Result<Self, TlsError> {
        let data = secret.data.clone().unwrap_or_default();
        let text = |key: &str| {
            data.get(key)
                .map(|b| String::from_utf8_lossy(&b.0).into_owned())
                .ok_or_else(|| TlsError::BadSecret(name.to_owned(), format!("no {key}")))
        };
        let material =
            Self { cert_pem: text("tls.crt")?, key_pem: text("tls.key")?, ca_pem: text("ca.crt")? };
        material.certified_key().map_err(|e| TlsError::BadSecret(name.to_owned(), e))?;
        Ok(material)
    }

    /// The certificate chain and key for rustls.
    pub fn certified_key(&self) -> Result<Arc<CertifiedKey>, String> {
        certified_key(self.cert_pem.as_bytes(), self.key_pem.as_bytes())
    }
}

fn certified_key(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<CertifiedKey>, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("the certificate: {e}"))?;
    if chain.is_empty() {
        return Err("no certificate in the PEM text".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("the key: {e}"))?;
    let provider = rustls::crypto::ring::default_provider();
    let signing =
        provider.key_provider.load_private_key(key).map_err(|e| format!("the key: {e}"))?;
    Ok(Arc::new(CertifiedKey::new(chain, signing)))
}

/// The Secret `namespace/name`'s certificate, made and stored first if there is none.
pub async fn own_certificate(
    client: kube::Client,
    namespace: &str,
    name: &str,
    dns_names: &[String],
) -> Result<Material, TlsError> {
    let secrets: Api<Secret> = Api::namespaced(client, namespace);
    let full = format!("{namespace}/{name}");
    if let Some(secret) = secrets.get_opt(name).await.map_err(|e| TlsError::Api(full.clone(), e))? {
        return Material::of(&secret, &full);
    }
    let material = Material::generate(dns_names)?;
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/part-of".to_owned(),
                "baleen".to_owned(),
            )])),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(material.data()),
        ..Default::default()
    };
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            tracing::info!(secret = full, "made the webhook's certificate");
            Ok(material)
        }
        // Another replica made it first: use that one, so that one CA verifies both.
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let secret = secrets.get(name).await.map_err(|e| TlsError::Api(full.clone(), e))?;
            Material::of(&secret, &full)
        }
        Err(e) => Err(TlsError::Api(full, e)),
    }
}

/// Keeps `ca_pem` as the `caBundle` of every webhook of the MutatingWebhookConfiguration
/// `name`, checked every `every` until `shutdown`; a failure is logged once until it mends.
pub async fn publish_ca(
    client: kube::Client,
    name: String,
    ca_pem: String,
    every: Duration,
    shutdown: CancellationToken,
) {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client);
    let bundle = base64::engine::general_purpose::STANDARD.encode(ca_pem.as_bytes());
    let mut failing = false;
    loop {
        let outcome = async {
            let current = api.get(&name).await?;
            let patches: Vec<serde_json::Value> = current
                .webhooks
                .iter()
                .flatten()
                .enumerate()
                .filter(|(_, w)| {
                    w.client_config.ca_bundle.as_ref().map(|b| b.0.as_slice())
                        != Some(ca_pem.as_bytes())
                })
                .map(|(i, _)| {
                    serde_json::json!({"op": "add", "path": format!("/webhooks/{i}/clientConfig/caBundle"), "value": bundle})
                })
                .collect();
            if !patches.is_empty() {
                let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(patches))
                    .map_err(kube::Error::SerdeError)?;
                api.patch(&name, &PatchParams::default(), &Patch::<()>::Json(patch)).await?;
                tracing::info!(configuration = name, "published the webhook's CA");
            }
            Ok::<_, kube::Error>(())
        }
        .await;
        match outcome {
            Ok(()) if failing => {
                failing = false;
                tracing::info!(configuration = name, "the webhook's CA is published again");
            }
            Ok(()) => {}
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(configuration = name, error = %e, "cannot publish the webhook's CA: the API server cannot call the webhook until it is (pods are admitted unchanged)");
            }
            Err(_) => {}
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// A certificate read from `tls.crt` and `tls.key` in a directory, read again when they
/// change (checked at most once a minute, at a handshake).
#[derive(Debug)]
pub struct DirectoryCertificate {
    dir: PathBuf,
    state: Mutex<(Instant, Option<std::time::SystemTime>, Arc<CertifiedKey>)>,
}

impl DirectoryCertificate {
    /// The certificate in `dir`, read now.
    pub fn load(dir: &Path) -> Result<Self, TlsError> {
        let (stamp, key) = Self::read(dir)?;
        Ok(Self { dir: dir.to_owned(), state: Mutex::new((Instant::now(), stamp, key)) })
    }

    fn read(dir: &Path) -> Result<(Option<std::time::SystemTime>, Arc<CertifiedKey>), TlsError> {
        let file = |name: &str| {
            let path = dir.join(name);
            std::fs::read(&path).map_err(|e| TlsError::File { path, reason: e.to_string() })
        };
        let cert = file("tls.crt")?;
        let key = file("tls.key")?;
        let stamp = Self::stamp(dir);
        let certified = certified_key(&cert, &key)
            .map_err(|reason| TlsError::File { path: dir.join("tls.crt"), reason })?;
        Ok((stamp, certified))
    }

    fn stamp(dir: &Path) -> Option<std::time::SystemTime> {
        std::fs::metadata(dir.join("tls.crt")).and_then(|m| m.modified()).ok()
    }
}

impl ResolvesServerCert for DirectoryCertificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if state.0.elapsed() >= Duration::from_secs(60) {
            state.0 = Instant::now();
            if Self::stamp(&self.dir) != state.1 {
                match Self::read(&self.dir) {
                    Ok((stamp, key)) => {
                        tracing::info!(dir = %self.dir.display(), "read the webhook's renewed certificate");
                        state.1 = stamp;
                        state.2 = key;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the webhook's certificate changed but cannot be read: the old one is kept")
                    }
                }
            }
        }
        Some(state.2.clone())
    }
}

/// A fixed certificate.
#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl ResolvesServerCert for Fixed {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// The TLS server configuration for `resolver` (HTTP/1.1: what the API server's webhook client
/// speaks to an HTTP/1 server).
pub fn server_config(
    resolver: Arc<dyn ResolvesServerCert>,
) -> Result<Arc<rustls::ServerConfig>, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The TLS server configuration of filter and prioritize behind a Service (`--tls-cert-dir`):
/// `resolver`'s certificate and, with `client_ca` (`--client-ca`, a PEM file of one or more
/// CA certificates, read once at start), only clients whose certificate one of them signed:
/// the kube-scheduler given the client certificate, nothing else that reaches the Service.
pub fn verbs_server_config(
    resolver: Arc<dyn ResolvesServerCert>,
    client_ca: Option<&Path>,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let refused = |path: &Path, reason: String| TlsError::File { path: path.to_owned(), reason };
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let mut config = match client_ca {
        None => builder.with_no_client_auth().with_cert_resolver(resolver),
        Some(path) => {
            let pem = std::fs::read(path).map_err(|e| refused(path, e.to_string()))?;
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|e| refused(path, format!("the certificate: {e}")))?;
                roots.add(cert).map_err(|e| refused(path, format!("a CA certificate: {e}")))?;
            }
            if roots.is_empty() {
                return Err(refused(path, "no CA certificate in the PEM text".into()));
            }
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .map_err(|e| refused(path, e.to_string()))?;
            builder.with_client_cert_verifier(verifier).with_cert_resolver(resolver)
        }
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The resolver of a fixed certificate.
pub fn fixed(material: &Material) -> Result<Arc<dyn ResolvesServerCert>, TlsError> {
    let key = material.certified_key().map_err(|e| TlsError::BadSecret("(made here)".into(), e))?;
    Ok(Arc::new(Fixed(key)))
}
