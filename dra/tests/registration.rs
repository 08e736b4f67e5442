//! Issue 26, item 1: the registration socket answers a gRPC C-core client (Python `grpcio`),
//! which sends the socket path percent-encoded as `:authority` as the kubelet's grpc-go does;
//! a tonic server on the same kind of socket resets that call (the bug this server exists for).
//! Needs Debian's `python3-grpcio` for `/usr/bin/python3` (`.ci/run` installs it).

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use baleen_dra::h2_unary::{self, Call, Status, Unary};
use baleen_dra::registration::{self, Registration, SUPPORTED_VERSIONS};
use baleen_proto::pluginregistration::v1 as reg;
use prost::Message as _;
use tokio_util::sync::CancellationToken;

const PYTHON: &str = "/usr/bin/python3";

/// One call by grpcio; `Ok(answer)` or `Err("CODE details")`.
async fn c_core_call(socket: &Path, method: &str, request: &[u8]) -> Result<Vec<u8>, String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/grpc_c_core_call.py");
    let hex: String = request.iter().map(|b| format!("{b:02x}")).collect();
    let socket = socket.to_owned();
    let method = method.to_owned();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(PYTHON).arg(&script).arg(&socket).arg(&method).arg(&hex).output()
    })
    .await
    .expect("join")
    .unwrap_or_else(|e| {
        panic!("cannot run {PYTHON} ({e}): install Debian's python3 and python3-grpcio")
    });
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(
        !text.starts_with("missing:"),
        "{text}: the registration tests need a gRPC C-core client"
    );
    assert!(out.status.success(), "grpcio failed: {text} {}", String::from_utf8_lossy(&out.stderr));
    if let Some(answer) = text.strip_prefix("ok") {
        let answer = answer.trim();
        Ok((0..answer.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&answer[i..i + 2], 16).expect("hex"))
            .collect())
    } else {
        Err(text.strip_prefix("error ").unwrap_or(&text).to_owned())
    }
}

#[tokio::test]
async fn a_grpc_c_core_client_registers_under_the_kubelets_authority() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = registration::socket_path(dir.path(), "gpu.awesome-ai-company.com");
    let endpoint = dir.path().join("plugin/dra.sock");
    let (service, mut verdict) = Registration::new("gpu.awesome-ai-company.com", &endpoint);
    let token = CancellationToken::new();
    let server = registration::serve(&socket, service, token.clone()).await.expect("serve");
    let served = tokio::spawn(server);

    let info = c_core_call(&socket, reg::GET_INFO_PATH, &[]).await.expect("GetInfo");
    let info = reg::PluginInfo::decode(info.as_slice()).expect("PluginInfo");
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpu.awesome-ai-company.com");
    assert_eq!(info.endpoint, endpoint.display().to_string());
    assert_eq!(info.supported_versions, SUPPORTED_VERSIONS);

    let refused =
        reg::RegistrationStatus { plugin_registered: false, error: "no DRA: gate off ✗".into() };
    let answer =
        c_core_call(&socket, reg::NOTIFY_PATH, &refused.encode_to_vec()).await.expect("Notify");
    reg::RegistrationStatusResponse::decode(answer.as_slice()).expect("response");
    verdict.changed().await.expect("a verdict");
    let seen = verdict.borrow().clone().expect("a verdict");
    assert!(!seen.registered);
    assert_eq!(seen.error, "no DRA: gate off ✗");

    // A method it does not serve, and a malformed message: gRPC errors, not a broken connection.
    let unknown = c_core_call(&socket, "/pluginregistration.Registration/Nope", &[]).await;
    assert!(unknown.as_ref().is_err_and(|e| e.starts_with("UNIMPLEMENTED")), "{unknown:?}");
    let malformed = c_core_call(&socket, reg::NOTIFY_PATH, &[0x0a, 0x05]).await;
    assert!(malformed.as_ref().is_err_and(|e| e.starts_with("INVALID_ARGUMENT")), "{malformed:?}");

    token.cancel();
    served.await.expect("server ends");
    assert!(!socket.exists(), "the socket is removed at shutdown");
}

/// Records the `:authority` of each call.
#[derive(Default)]
struct Echo(Mutex<Vec<String>>);

impl Unary for Echo {
    fn call(&self, call: &Call<'_>) -> Result<Vec<u8>, Status> {
        self.0.lock().expect("lock").push(call.authority.to_owned());
        Ok(call.message.to_vec())
    }
}

#[tokio::test]
async fn the_c_core_client_sends_the_path_as_authority_and_tonic_refuses_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    // What authority grpcio sends: the path, percent-encoded (the kubelet's grpc-go does too).
    let ours = dir.path().join("echo-reg.sock");
    let listener = tokio::net::UnixListener::bind(&ours).expect("bind");
    let echo = Arc::new(Echo::default());
    let serving = echo.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let e = serving.clone();
            tokio::spawn(async move { h2_unary::serve(stream, &*e, h2_unary::IDLE).await });
        }
    });
    let answer = c_core_call(&ours, "/x.Y/Z", &[1, 2, 3]).await.expect("echo");
    assert_eq!(answer, [1, 2, 3]);
    let authority = echo.0.lock().expect("lock")[0].clone();
    assert_eq!(authority, ours.display().to_string().replace('/', "%2F"), "the authority seen");

    // The same call to tonic's server (the generated Registration service) on a unix socket
    // fails: h2 resets the stream for that authority. If this ever passes, h2 has changed and
    // the tonic server could serve registration after all (docs/dra.md says why it cannot).
    struct Tonic;
    #[tonic::async_trait]
    impl reg::registration_server::Registration for Tonic {
        async fn get_info(
            &self,
            _: tonic::Request<reg::InfoRequest>,
        ) -> Result<tonic::Response<reg::PluginInfo>, tonic::Status> {
            Ok(tonic::Response::new(reg::PluginInfo::default()))
        }
        async fn notify_registration_status(
            &self,
            _: tonic::Request<reg::RegistrationStatus>,
        ) -> Result<tonic::Response<reg::RegistrationStatusResponse>, tonic::Status> {
            Ok(tonic::Response::new(reg::RegistrationStatusResponse {}))
        }
    }
    let theirs = dir.path().join("tonic-reg.sock");
    let listener = tokio::net::UnixListener::bind(&theirs).expect("bind");
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(reg::registration_server::RegistrationServer::new(Tonic))
            .serve_with_incoming(incoming),
    );
    let refused = c_core_call(&theirs, reg::GET_INFO_PATH, &[]).await;
    assert!(refused.is_err(), "tonic's server answered the kubelet's authority: {refused:?}");
}
