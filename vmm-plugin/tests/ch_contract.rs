//! Contract tests of the Cloud Hypervisor backend against Cloud Hypervisor's own API
//! description, read at test time from ../shared/cloud-hypervisor/openapi.yaml.
//!
//! A real Cloud Hypervisor cannot run on these machines (no usable KVM), so the spec is the
//! oracle. The backend talks to the recording stand-in of `rdmamig_testbed::ch_spec`, which
//! answers with statuses and bodies taken from (and checked against) the spec:
//! - every recorded request's path and method exist in the spec, and its body validates
//!   against the request schema of that path and method (unknown properties included);
//! - for every endpoint the backend uses, the statuses it gives a meaning to are the ones
//!   the spec lists and those NOTES.md records a real Cloud Hypervisor answering beyond it
//!   (200 from `vmm.shutdown`, 500 for refusals), and each one, answered for real, comes out
//!   as success or as a typed error carrying the body's error chain;
//! - where the notes and the spec differ, the backend acts as the real server needs: its
//!   shutdown's 200 is success, a 500 refusal is `Refused` (or `NotFound` when it says there
//!   is no VM), a failed migration quotes the VMM's log, a VMM that dies mid-migration is
//!   noticed at once, and a destination a failed receive left `Created` receives again;
//! - the bodies the stand-in answers with validate against the spec's response schemas, so
//!   it cannot drift from what Cloud Hypervisor sends.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdmamig_testbed::ch_spec::{
    append_event, check_against_spec, endpoint_of, operation, refusal, response_schema, spec_body,
    spec_statuses, successful, validate, vm_info, FakeCh,
};
use rdmamig_vmm::ch_api::{classify, ApiClient, ApiError, Endpoint, Request, PREFIX};
use rdmamig_vmm::{
    ChConfig, ChVmm, DeviceSpec, MigrationLimits, MigrationStatus, TimeoutStrategy, VfioHandover,
    VmPhase, Vmm, VmmError,
};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------
// The tests

#[test]
fn the_checker_rejects_what_the_spec_rejects() {
    // The oracle itself must be able to fail: bodies Cloud Hypervisor would refuse.
    let send = &operation("/vm.send-migration", "put").unwrap()["requestBody"]["content"]
        ["application/json"]["schema"];
    assert!(validate(send, &json!({"destination_url": "unix:/x"}), "b").is_ok());
    for bad in [
        json!({}),
        json!({"destination_url": 3}),
        json!({"destination_url": "unix:/x", "downtime_ms": 0}),
        json!({"destination_url": "unix:/x", "timeout_strategy": "cancel"}),
        json!({"destination_url": "unix:/x", "connections": 129}),
        json!({"destination_url": "unix:/x", "destnation": "typo"}),
    ] {
        assert!(validate(send, &bad, "b").is_err(), "{bad}");
    }
    let vsock = &operation("/vm.add-vsock", "put").unwrap()["requestBody"]["content"]
        ["application/json"]["schema"];
    assert!(validate(vsock, &json!({"cid": 2, "socket": "/s"}), "b").is_err());
    assert!(validate(
        vsock,
        &json!({"cid": 3, "socket": "/s", "pci_device_id": 256}),
        "b"
    )
    .is_err());
}

#[test]
fn every_endpoint_is_in_the_spec_and_handles_its_statuses_and_the_observed_ones() {
    let notes = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/cloud-hypervisor/NOTES.md"),
    )
    .expect("../shared/cloud-hypervisor/NOTES.md");
    for endpoint in Endpoint::ALL {
        let what = format!("{} {}", endpoint.method(), endpoint.path());
        let listed = spec_statuses(endpoint);
        let declared: BTreeSet<u16> = endpoint.spec_statuses().iter().copied().collect();
        assert_eq!(
            listed, declared,
            "{what}: the spec's statuses vs the backend's copy"
        );
        let handled: BTreeSet<u16> = endpoint.statuses().into_iter().collect();
        let mut expected = listed.clone();
        expected.extend(endpoint.observed_statuses());
        assert_eq!(handled, expected, "{what}: statuses handled by the backend");
        // Each status beyond the spec is one the notes record a real server answering.
        for status in endpoint.observed_statuses() {
            let recorded = match (endpoint, status) {
                (Endpoint::VmmShutdown, 200) => {
                    notes.contains("`PUT /api/v1/vmm.shutdown` answers 200")
                }
                (_, 500) => notes.contains("Refusals come as 500"),
                _ => false,
            };
            assert!(recorded, "{what}: {status} is not in NOTES.md");
        }
    }
}

/// A valid body for endpoints that take one.
fn sample_request(endpoint: Endpoint) -> Option<Request> {
    Some(match endpoint {
        Endpoint::VmAddDevice => Request::AddDevice {
            path: "/sys/bus/pci/devices/0000:00:02.0".into(),
            id: "vf0".into(),
        },
        Endpoint::VmRemoveDevice => Request::RemoveDevice { id: "vf0".into() },
        Endpoint::VmAddVsock => Request::AddVsock {
            cid: 3,
            socket: "/run/vm.vsock".into(),
            id: None,
        },
        Endpoint::VmSendMigration => Request::SendMigration {
            destination_url: "unix:/run/mig.sock".into(),
            local: false,
            downtime_ms: None,
            timeout_s: None,
            timeout_strategy: TimeoutStrategy::Cancel,
            connections: Some(4),
            tls_dir: Some("/etc/tls".into()),
        },
        // vfio_fds and iommufd_fd are not in the spec at ae44c29 (NOTES.md: its main branch
        // after v53); their bodies are checked in tests/tests/ch_move.rs.
        Endpoint::VmReceiveMigration => Request::ReceiveMigration {
            receiver_url: "unix:/run/mig.sock".into(),
            tls_dir: None,
            vfio_fds: Vec::new(),
            iommufd_fd: None,
        },
        _ => return None,
    })
}

#[tokio::test]
async fn every_status_the_spec_lists_is_handled_with_its_message() {
    let answer: Arc<Mutex<u16>> = Arc::new(Mutex::new(200));
    let current = answer.clone();
    let fake = FakeCh::start(move |path, _| {
        let status = *current.lock().unwrap();
        (status, spec_body(endpoint_of(path), status))
    });
    let client = ApiClient::new(fake.socket(), Duration::from_secs(5));
    let mut checked = 0;
    for endpoint in Endpoint::ALL {
        for status in endpoint.statuses() {
            *answer.lock().unwrap() = status;
            let request = sample_request(endpoint);
            let result = client.call(endpoint, request.as_ref()).await;
            let what = format!(
                "{} {} answered {status}",
                endpoint.method(),
                endpoint.path()
            );
            if (200..300).contains(&status) {
                let body = result.unwrap_or_else(|e| panic!("{what}: {e}"));
                if let Some(schema) = response_schema(endpoint, status) {
                    let value: Value = serde_json::from_slice(&body).unwrap();
                    validate(schema, &value, "answer").unwrap();
                }
            } else {
                let err = result.expect_err(&what);
                match &err {
                    ApiError::Status {
                        status: got,
                        message,
                        outcome,
                        ..
                    } => {
                        assert_eq!(*got, status, "{what}");
                        assert_eq!(
                            message,
                            &format!("Error from API: marker {status}"),
                            "{what}: the error chain is carried"
                        );
                        assert_eq!(Some(*outcome), classify(endpoint, status, message));
                    }
                    other => panic!("{what}: not a status error: {other}"),
                }
                let kind = err.into_vmm("obj");
                match status {
                    404 => assert!(matches!(kind, VmmError::NotFound { .. }), "{what}: {kind}"),
                    409 => assert!(matches!(kind, VmmError::Conflict { .. }), "{what}: {kind}"),
                    _ => assert!(
                        matches!(&kind, VmmError::Refused { class, .. } if class == &format!("HTTP {status}")),
                        "{what}: {kind}"
                    ),
                }
                assert!(
                    kind.to_string().contains(&format!("marker {status}")),
                    "{kind}"
                );
            }
            checked += 1;
        }
        // A status the spec does not list is a protocol error, never success.
        *answer.lock().unwrap() = 418;
        let err = client
            .call(endpoint, sample_request(endpoint).as_ref())
            .await
            .unwrap_err();
        assert!(matches!(err, ApiError::Unexpected { .. }), "{err}");
    }
    assert!(checked >= 20, "{checked} statuses checked");
    check_against_spec(&fake.recorded());
}

#[tokio::test]
async fn every_request_the_backend_sends_matches_the_spec() {
    let fake = FakeCh::start(successful);
    let mut config = fake.config();
    let vmm = ChVmm::connect(config.clone()).await.unwrap();
    vmm.status().await.unwrap();
    vmm.pause().await.unwrap();
    vmm.resume().await.unwrap();
    let vf = DeviceSpec::parse("driver=vfio-pci,host=0000:3b:02.1,id=vf1").unwrap();
    let added = vmm.add_device(&vf).await.unwrap();
    assert_eq!(
        added.bdf.as_deref(),
        Some("x"),
        "PciDeviceInfo.bdf as the spec made it"
    );
    assert!(!vmm.has_device("vf1").await.unwrap());
    vmm.remove_device("vf0", Duration::from_secs(1))
        .await
        .unwrap();
    vmm.add_vsock(3, &fake.path("vm.vsock"), None)
        .await
        .unwrap();
    vmm.add_vsock(4, &fake.path("vm.vsock"), Some("vsock0"))
        .await
        .unwrap();
    for limits in [
        MigrationLimits::default(),
        MigrationLimits {
            downtime: Some(Duration::from_millis(250)),
            timeout: Some(Duration::from_secs(60)),
            ..MigrationLimits::default()
        },
        MigrationLimits {
            downtime: Some(Duration::from_micros(10)),
            timeout: Some(Duration::from_millis(10)),
            timeout_strategy: TimeoutStrategy::Ignore,
            local: false,
            connections: Some(128),
        },
    ] {
        vmm.send_migration("tcp:127.0.0.1:6000", &limits)
            .await
            .unwrap();
    }
    vmm.prepare_incoming("tcp:127.0.0.1:6000", VfioHandover::default())
        .await
        .unwrap();
    vmm.wait_received(Duration::from_secs(5)).await.unwrap();
    vmm.quit().await.unwrap();
    // The variants a configuration changes: local migration, TLS on receive.
    config.tls_dir = Some(fake.path("tls"));
    let local = ChVmm::connect(config).await.unwrap();
    let limits = MigrationLimits {
        local: true,
        ..MigrationLimits::default()
    };
    local
        .send_migration("unix:/run/mig.sock", &limits)
        .await
        .unwrap();
    local
        .prepare_incoming("tcp:127.0.0.1:6001", VfioHandover::default())
        .await
        .unwrap();
    local.wait_received(Duration::from_secs(5)).await.unwrap();

    let recorded = fake.recorded();
    check_against_spec(&recorded);
    let used: BTreeSet<&str> = recorded.iter().map(|r| r.path.as_str()).collect();
    for endpoint in Endpoint::ALL {
        assert!(
            used.contains(format!("{PREFIX}{}", endpoint.path()).as_str()),
            "{} was never exercised",
            endpoint.path()
        );
    }
    let bodies: Vec<&Value> = recorded.iter().filter_map(|r| r.body.as_ref()).collect();
    assert!(bodies.contains(&&json!({"path": "/sys/bus/pci/devices/0000:3b:02.1", "id": "vf1"})));
    assert!(bodies.contains(
        &&json!({"destination_url": "tcp:127.0.0.1:6000", "local": false,
        "downtime_ms": 250, "timeout_s": 60, "timeout_strategy": "Cancel"})
    ));
    assert!(bodies.contains(
        &&json!({"destination_url": "tcp:127.0.0.1:6000", "local": false,
        "downtime_ms": 1, "timeout_s": 1, "timeout_strategy": "Ignore", "connections": 128})
    ));
}

#[tokio::test]
async fn a_204_from_send_migration_is_not_success() {
    // No event monitor: the VM stays on the source (what a failed migration leaves), so the
    // wait ends at its deadline, never in success.
    let fake = FakeCh::start(|path, body| match path {
        "/vm.info" => (200, vm_info("Running", &[])),
        _ => successful(path, body),
    });
    let vmm = ChVmm::connect(fake.config()).await.unwrap();
    vmm.send_migration("unix:/nowhere", &MigrationLimits::default())
        .await
        .unwrap();
    let mut samples = Vec::new();
    let err = vmm
        .wait_migration(Duration::from_millis(300), &mut |p| {
            samples.push(p.status.clone())
        })
        .await
        .unwrap_err();
    assert!(matches!(err, VmmError::TimedOut { .. }), "{err}");
    assert!(samples.iter().all(|s| *s == MigrationStatus::Active));
    check_against_spec(&fake.recorded());
}

#[tokio::test]
async fn the_source_losing_the_vm_confirms_the_migration() {
    let gone = Arc::new(Mutex::new(false));
    let flag = gone.clone();
    let fake = FakeCh::start(move |path, body| match path {
        "/vm.info" if *flag.lock().unwrap() => (404, spec_body(Endpoint::VmInfo, 404)),
        "/vm.info" => (200, vm_info("Running", &[])),
        _ => successful(path, body),
    });
    let vmm = ChVmm::connect(fake.config()).await.unwrap();
    vmm.send_migration("unix:/dst", &MigrationLimits::default())
        .await
        .unwrap();
    let mut samples = 0;
    let early = vmm
        .wait_migration(Duration::from_millis(100), &mut |_| samples += 1)
        .await;
    assert!(early.is_err());
    *gone.lock().unwrap() = true;
    let done = vmm
        .wait_migration(Duration::from_secs(5), &mut |_| {})
        .await
        .unwrap();
    assert_eq!(done.status, MigrationStatus::Completed);
    assert!(samples > 0);
}

#[tokio::test]
async fn the_event_monitor_tells_failure_from_success() {
    let fake = FakeCh::start(successful);
    let events = fake.path("events.json");
    // An earlier migration's outcome is not this one's.
    append_event(&events, "migration-finished");
    let mut config = fake.config();
    config.event_monitor = Some(events.clone());
    let vmm = ChVmm::connect(config).await.unwrap();

    vmm.send_migration("unix:/dst", &MigrationLimits::default())
        .await
        .unwrap();
    append_event(&events, "migration-started");
    append_event(&events, "migration-memory-iteration");
    append_event(&events, "migration-failed");
    append_event(&events, "resumed");
    let mut statuses = Vec::new();
    let err = vmm
        .wait_migration(Duration::from_secs(5), &mut |p| {
            statuses.push(p.status.clone())
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            VmmError::MigrationFailed {
                status: MigrationStatus::Failed,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        statuses,
        [
            MigrationStatus::Active,
            MigrationStatus::Active,
            MigrationStatus::Failed
        ]
    );

    vmm.send_migration("unix:/dst", &MigrationLimits::default())
        .await
        .unwrap();
    let mut ignore = |_: &rdmamig_vmm::MigrationProgress| {};
    let wait = vmm.wait_migration(Duration::from_secs(5), &mut ignore);
    let writer = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        append_event(&events, "migration-started");
        append_event(&events, "paused");
        append_event(&events, "migration-finished");
    };
    let (done, ()) = tokio::join!(wait, writer);
    assert_eq!(done.unwrap().status, MigrationStatus::Completed);
}

#[tokio::test]
async fn a_failed_receive_carries_the_chain() {
    let fake = FakeCh::start(|path, body| {
        match path {
        "/vm.receive-migration" => (
            500,
            br#"["Error from API","Error receiving migration","Socket error","failed to fill whole buffer"]"#.to_vec(),
        ),
        _ => successful(path, body),
    }
    });
    let vmm = ChVmm::connect(fake.config()).await.unwrap();
    vmm.prepare_incoming("tcp:127.0.0.1:6000", VfioHandover::default())
        .await
        .unwrap();
    let err = vmm.wait_received(Duration::from_secs(5)).await.unwrap_err();
    assert!(
        matches!(&err, VmmError::MigrationFailed { reason, .. } if reason.ends_with("Socket error: failed to fill whole buffer")),
        "{err}"
    );
}

#[tokio::test]
async fn the_receiver_confirms_a_received_migration_and_an_empty_vmm_is_no_vm() {
    let arrived = Arc::new(Mutex::new(false));
    let flag = arrived.clone();
    let fake = FakeCh::start(move |path, body| match path {
        "/vm.info" if *flag.lock().unwrap() => (200, vm_info("Running", &[])),
        "/vm.info" => (404, spec_body(Endpoint::VmInfo, 404)),
        "/vm.receive-migration" => {
            *flag.lock().unwrap() = true;
            successful(path, body)
        }
        _ => successful(path, body),
    });
    let vmm = ChVmm::connect(fake.config()).await.unwrap();
    let empty = vmm.status().await.unwrap();
    assert_eq!(empty.phase, VmPhase::NoVm, "{empty:?}");
    vmm.prepare_incoming("tcp:127.0.0.1:6000", VfioHandover::default())
        .await
        .unwrap();
    vmm.confirm_received(Duration::from_secs(5)).await.unwrap();
    assert_eq!(vmm.status().await.unwrap().phase, VmPhase::Running);
    check_against_spec(&fake.recorded());
}

#[tokio::test]
async fn a_migration_the_receiver_failed_or_never_got_is_not_confirmed() {
    let fake = FakeCh::start(|path, body| {
        match path {
        "/vm.receive-migration" => (
            500,
            br#"["Error from API","Error receiving migration","Socket error","failed to fill whole buffer"]"#.to_vec(),
        ),
        // What a real destination shows after a failed receive (NOTES.md).
        "/vm.info" => (200, vm_info("Created", &[])),
        _ => successful(path, body),
    }
    });
    let vmm = ChVmm::connect(fake.config()).await.unwrap();
    vmm.prepare_incoming("tcp:127.0.0.1:6000", VfioHandover::default())
        .await
        .unwrap();
    let err = vmm
        .confirm_received(Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, VmmError::MigrationFailed { reason, .. } if reason.contains("Socket error")),
        "{err}"
    );
    // A session that did not send the receive request (another migrator did) sees no VM.
    let other = ChVmm::connect(fake.config()).await.unwrap();
    let err = other
        .confirm_received(Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, VmmError::MigrationFailed { reason, .. } if reason.contains("no VM")),
        "{err}"
    );
    check_against_spec(&fake.recorded());
}

#[tokio::test]
async fn a_device_the_guest_keeps_misses_the_deadline_and_is_asked_once() {
    let fake = FakeCh::start(|path, body| match path {
        "/vm.info" => (200, vm_info("Running", &["vf0"])),
        _ => successful(path, body),
    });
    let vmm = ChVmm::connect(fake.config()).await.unwrap();
    let err = vmm
        .remove_device("vf0", Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, VmmError::DeviceNotReleased { device, .. } if device == "vf0"),
        "{err}"
    );
    vmm.remove_device("vf0", Duration::from_millis(100))
        .await
        .unwrap_err();
    let asks = fake
        .recorded()
        .iter()
        .filter(|r| r.path.ends_with("/vm.remove-device"))
        .count();
    assert_eq!(asks, 1, "a second remove only waits");
    assert!(vmm.has_device("vf0").await.unwrap());
}

#[tokio::test]
async fn errors_name_the_object_and_a_dead_socket_is_a_connect_error() {
    let fake = FakeCh::start(|path, body| {
        match path {
        "/vm.add-device" => (409, spec_body(Endpoint::VmAddDevice, 409)),
        "/vm.remove-device" => (
            404,
            br#"["Error from API","The device could not be removed from the VM","Error from device manager","Failed to find device corresponding to the given identifier: nope"]"#.to_vec(),
        ),
        _ => successful(path, body),
    }
    });
    let vmm = ChVmm::connect(fake.config()).await.unwrap();
    let vf = DeviceSpec::parse("driver=vfio-pci,host=0000:3b:02.1,id=vf1").unwrap();
    let err = vmm.add_device(&vf).await.unwrap_err();
    assert!(
        matches!(&err, VmmError::Conflict { object, .. } if object == "vf1"),
        "{err}"
    );
    let err = vmm
        .remove_device("nope", Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, VmmError::NotFound { object, message, .. }
            if object == "nope" && message.ends_with("given identifier: nope")),
        "{err}"
    );
    let nic = DeviceSpec::parse("driver=virtio-net-pci,id=n1").unwrap();
    assert!(matches!(
        vmm.add_device(&nic).await.unwrap_err(),
        VmmError::Unsupported { .. }
    ));
    assert!(matches!(
        vmm.cancel_migration().await.unwrap_err(),
        VmmError::Unsupported { .. }
    ));
    assert!(matches!(
        vmm.open_agent_channel().await.err(),
        Some(VmmError::NoAgentChannel)
    ));
    check_against_spec(&fake.recorded());

    let missing = ChConfig::new(fake.path("no-such.sock"));
    assert!(matches!(
        ChVmm::connect(missing).await.unwrap_err(),
        VmmError::Connect { .. }
    ));
}

// ---------------------------------------------------------------------------------------
// Where a real Cloud Hypervisor answers otherwise than its spec (NOTES.md)

#[tokio::test]
async fn a_shutdown_answered_200_as_the_real_server_does_is_success() {
    let fake = FakeCh::start(successful);
    let vmm = ChVmm::connect(fake.config()).await.unwrap();
    vmm.quit().await.unwrap();
    assert!(fake
        .recorded()
        .iter()
        .any(|r| r.path.ends_with("/vmm.shutdown")));
}

#[tokio::test]
async fn refusals_sent_as_500_are_refusals_or_a_missing_vm() {
    let fake = FakeCh::start(|path, body| match path {
        "/vm.pause" => refusal(&[
            "Error from API",
            "The VM could not be paused",
            "InvalidStateTransition(Paused, Paused)",
        ]),
        "/vm.resume" => refusal(&[
            "Error from API",
            "The VM could not be resumed",
            "InvalidStateTransition(Running, Running)",
        ]),
        "/vm.remove-device" => refusal(&["Error from API", "VM is not running"]),
        _ => successful(path, body),
    });
    let vmm = ChVmm::connect(fake.config()).await.unwrap();
    let paused = vmm.pause().await.unwrap_err();
    assert!(
        matches!(&paused, VmmError::Refused { class, message, .. }
            if class == "HTTP 500" && message.contains("InvalidStateTransition(Paused, Paused)")),
        "{paused}"
    );
    let running = vmm.resume().await.unwrap_err();
    assert!(
        matches!(&running, VmmError::Refused { message, .. } if message.contains("(Running, Running)")),
        "{running}"
    );
    let none = vmm
        .remove_device("vf0", Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(
        matches!(&none, VmmError::NotFound { message, .. } if message.contains("VM is not running")),
        "{none}"
    );
    check_against_spec(&fake.recorded());
}

#[tokio::test]
async fn a_failed_migration_quotes_the_end_of_the_vmm_log() {
    let fake = FakeCh::start(successful);
    let events = fake.path("events.json");
    let log = fake.path("ch.log");
    std::fs::write(
        &log,
        "cloud-hypervisor: 1.2s: <vmm> INFO:vmm/src/lib.rs: Migration started\n\
         cloud-hypervisor: 1.3s: <vmm> ERROR:vmm/src/lib.rs: Could not get vCPU state \
         GetNestedState(Invalid argument (os error 22))\n",
    )
    .unwrap();
    let mut config = fake.config();
    config.event_monitor = Some(events.clone());
    config.log_file = Some(log);
    let vmm = ChVmm::connect(config).await.unwrap();
    vmm.send_migration("unix:/dst", &MigrationLimits::default())
        .await
        .unwrap();
    append_event(&events, "migration-started");
    append_event(&events, "migration-failed");
    let mut ignore = |_: &rdmamig_vmm::MigrationProgress| {};
    let err = vmm
        .wait_migration(Duration::from_secs(5), &mut ignore)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, VmmError::MigrationFailed { reason, .. }
            if reason.contains("GetNestedState(Invalid argument (os error 22))")),
        "{err}"
    );
}

#[tokio::test]
async fn a_vmm_that_dies_during_a_migration_is_noticed_at_once_and_named() {
    let events_dir = tempfile::tempdir().unwrap();
    let events = events_dir.path().join("events.json");
    append_event(&events, "migration-finished");
    let fake = FakeCh::start(successful);
    let socket = fake.socket();
    let mut config = fake.config();
    config.event_monitor = Some(events.clone());
    let vmm = ChVmm::connect(config).await.unwrap();
    vmm.send_migration("unix:/dst", &MigrationLimits::default())
        .await
        .unwrap();
    append_event(&events, "migration-started");
    // The VMM dies: its API socket goes, its event file just stops growing.
    drop(fake);
    let started = std::time::Instant::now();
    let mut ignore = |_: &rdmamig_vmm::MigrationProgress| {};
    let err = vmm
        .wait_migration(Duration::from_secs(60), &mut ignore)
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "noticed only after {:?}",
        started.elapsed()
    );
    assert!(
        matches!(&err, VmmError::Died { socket: named, .. } if named == &socket.display().to_string()),
        "{err}"
    );
}

#[tokio::test]
async fn a_destination_a_failed_receive_left_created_receives_again() {
    let deleted = Arc::new(Mutex::new(false));
    let flag = deleted.clone();
    let fake = FakeCh::start(move |path, body| match path {
        "/vm.info" if !*flag.lock().unwrap() => (200, vm_info("Created", &[])),
        "/vm.info" => (404, spec_body(Endpoint::VmInfo, 404)),
        "/vm.delete" => {
            *flag.lock().unwrap() = true;
            successful(path, body)
        }
        _ => successful(path, body),
    });
    let vmm = ChVmm::connect(fake.config()).await.unwrap();
    let status = vmm.status().await.unwrap();
    assert_eq!(status.phase, VmPhase::NoVm, "{status:?}");
    assert_eq!(status.state, "Created");
    vmm.prepare_incoming("tcp:127.0.0.1:6000", VfioHandover::default())
        .await
        .unwrap();
    // The receive request goes from a task of its own (it stays open until the end).
    let sent = |paths: &[String]| paths.iter().any(|p| p.ends_with("/vm.receive-migration"));
    let mut paths: Vec<String> = Vec::new();
    for _ in 0..200 {
        paths = fake.recorded().into_iter().map(|r| r.path).collect();
        if sent(&paths) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let delete = paths.iter().position(|p| p.ends_with("/vm.delete"));
    let receive = paths
        .iter()
        .position(|p| p.ends_with("/vm.receive-migration"));
    assert!(
        matches!((delete, receive), (Some(d), Some(r)) if d < r),
        "the Created VM was not deleted before the receive: {paths:?}"
    );
    // And it can be discarded: the real server's 200 from vmm.shutdown.
    vmm.quit().await.unwrap();
    check_against_spec(&fake.recorded());
}

/// A receive that hands VFIO devices over names them in the body (each id with its
/// descriptor's number) and sends the descriptors beside the request, devices first, then
/// the iommufd (the stand-in reads them as Cloud Hypervisor's server does, with recvmsg).
#[tokio::test]
async fn a_receive_hands_vfio_devices_over_beside_the_request() {
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::os::unix::fs::MetadataExt;
    let fake = FakeCh::start(successful);
    let vmm = ChVmm::connect(fake.config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let open = |name: &str| {
        let file = std::fs::File::create(dir.path().join(name)).unwrap();
        let meta = file.metadata().unwrap();
        (Arc::new(OwnedFd::from(file)), (meta.dev(), meta.ino()))
    };
    let (cdev, cdev_id) = open("vfio3");
    let (iommu, iommu_id) = open("iommu");
    let handover = VfioHandover {
        devices: vec![("vf0".into(), cdev.clone())],
        iommufd: Some(iommu.clone()),
    };
    vmm.prepare_incoming("tcp:127.0.0.1:6000", handover)
        .await
        .unwrap();
    vmm.wait_received(Duration::from_secs(5)).await.unwrap();
    let recorded = fake.recorded();
    let receive = recorded
        .iter()
        .find(|r| r.path.ends_with("/vm.receive-migration"))
        .unwrap();
    assert_eq!(
        receive.body,
        Some(json!({"receiver_url": "tcp:127.0.0.1:6000",
            "vfio_fds": [{"id": "vf0", "fd": cdev.as_raw_fd()}],
            "iommufd_fd": iommu.as_raw_fd()}))
    );
    assert_eq!(receive.fds, [cdev_id, iommu_id]);
    // Only the receive carries descriptors.
    assert!(recorded
        .iter()
        .filter(|r| !r.path.ends_with("/vm.receive-migration"))
        .all(|r| r.fds.is_empty()));
}
