//! Migrator to migrator on the test bed: three `rdmamig daemon`s play three hosts, each with
//! its own config, pool, state and API socket, and certificates generated for the test (one
//! CA). The source daemon moves a VM with live RDMA traffic to a QEMU whose host duties
//! (reserve a function from its pool, ready the VMM to receive, plug the function, resume the
//! connections through the agent) the destination daemon does, asked over mutual TLS. Before
//! that, with the traffic running: a destination that presents a certificate other than the
//! one the source lists for that name is refused by the sending side, and a destination
//! migrator without a free function refuses the reservation; both moves roll back at
//! prepare, before anything in the VM is touched. The source's own credentials cannot make
//! the destination act outside the source's moves: a `Discard` of a VMM outside the
//! destination's `vmm_paths` (the peer VM), a `Discard` of one no move of the source readied,
//! and a host device plugged without a pool function are refused, logged with the peer, and
//! nothing is stopped. Strategy `hot`, asked for by its former name `vfio-migrate`, is
//! refused for a source function this host's pool does not have, before anything happens;
//! the move itself runs with `auto`, which picks `reconnect` (the destination migrator's
//! VMM was not asked whether it has the NIC that `hot` would migrate) and says why. Nothing
//! is lost, duplicated or reordered.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rdmamig_migrator::config::KnownPeer;
use rdmamig_migrator::destination::MoveRef;
use rdmamig_migrator::peer::{
    self, PeerAnswer, PeerCall, PeerRequest, PeerTls, PEER_PROTOCOL_VERSION,
};
use rdmamig_migrator::plan::Endpoint;
use rdmamig_testbed::pki::{free_port, Pki};
use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::steps::{
    assert_served_a_move, finish_clean_flow, migrate_command, MoveGuests,
};
use rdmamig_testbed::{error_chain, Testbed};
use rdmamig_vmm::DeviceSpec;
use serde_json::Value;

const TAG: &str = "flow";

/// Writes daemon `name`'s config; with `RDMAMIG_RECORD_CORPUS=<dir>` it is also kept there
/// as a seed of the `config` fuzz target.
fn write_config(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    rdmamig_testbed::corpus::keep("config", name, &[text.as_bytes().to_vec()]).unwrap();
    path
}

/// Runs `rdmamig migrate` for `src` → `dst` through `daemon`, with `args` added; returns the
/// exit code, stdout and the report.
fn migrate(
    daemon: &Daemon,
    guests: &MoveGuests,
    report: &Path,
    args: &[&str],
) -> (Option<i32>, String, Value) {
    let out = migrate_command(daemon.socket(), &guests.src, &guests.dst)
        .args(args)
        .arg("--report")
        .arg(report)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let report = std::fs::read(report)
        .map(|bytes| serde_json::from_slice(&bytes).unwrap())
        .unwrap_or(Value::Null);
    (out.status.code(), stdout, report)
}

fn phases(report: &Value) -> Vec<&str> {
    report["timeline"]["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect()
}

/// Asks the destination migrator, with the source's own (authenticated) identity, for what
/// no move of the source opened: a `Discard` of the peer VM's QEMU (outside the
/// destination's `vmm_paths`), a `Discard` of the waiting destination QEMU, and a
/// `vfio-pci,host=` device plugged into it without a pool function. Each is refused, and
/// the peer VM still runs (the destination QEMU's later move shows it still waits).
fn refused_outside_scope(pki: &Pki, destination_port: u16, guests: &MoveGuests) {
    let known = [KnownPeer {
        name: "dst".into(),
        cert: pki.file("destination", "pem"),
        address: Some(format!("127.0.0.1:{destination_port}")),
    }];
    let tls = PeerTls::load(
        &pki.file("source", "pem"),
        &pki.file("source", "key"),
        &pki.file("ca", "pem"),
        &known,
    )
    .unwrap();
    let target = tls.resolve("dst").unwrap();
    let probe = MoveRef {
        move_id: "probe".into(),
        vm: guests.src.spec().name.clone(),
    };
    let arrivals = Endpoint::Qemu {
        qmp: guests.dst.qmp_socket(),
        agent: Some(guests.dst.agent_socket()),
    };
    let calls = [
        (
            PeerCall::Discard {
                endpoint: Endpoint::Qemu {
                    qmp: guests.peer.qmp_socket(),
                    agent: None,
                },
                of: probe.clone(),
            },
            "is not under any of this host's [peer] vmm_paths",
        ),
        (
            PeerCall::Discard {
                endpoint: arrivals.clone(),
                of: probe.clone(),
            },
            "move probe was not opened here",
        ),
        (
            PeerCall::Attach {
                endpoint: arrivals,
                of: probe,
                function: None,
                device: DeviceSpec::parse("driver=vfio-pci,id=probe,host=0000:00:02.0").unwrap(),
                check_first: false,
            },
            "names host hardware (driver=vfio-pci)",
        ),
    ];
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for (call, expected) in calls {
        let request = PeerRequest {
            version: PEER_PROTOCOL_VERSION,
            deadline_ms: 10_000,
            call,
        };
        let answer = runtime
            .block_on(peer::call(&tls, &target, &request))
            .unwrap();
        match answer {
            PeerAnswer::Refused { reason } => assert!(
                reason.contains("outside this peer's scope") && reason.contains(expected),
                "{reason}"
            ),
            answer => panic!("{:?} was done: {answer:?}", request.call),
        }
    }
    let status = guests
        .peer
        .qmp()
        .unwrap()
        .execute("query-status", serde_json::json!({}))
        .unwrap();
    assert_eq!(status["status"], "running", "the peer VM: {status}");
}

#[test]
fn a_vm_moves_to_another_migrators_qemu_over_mutual_tls_and_refusals_roll_back() {
    let bed = Testbed::new("twomigrators").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let pki = Pki::new(&bed.dir().join("pki")).unwrap();
    for host in ["source", "destination", "full", "stranger"] {
        pki.issue(host).unwrap();
    }
    let (destination_port, full_port) = (free_port().unwrap(), free_port().unwrap());
    // The source lists the destination twice: as `dst` with its real certificate, and as
    // `impostor` with another host's, at the same address.
    let source_config = format!(
        "[[pool.function]]\nname = \"tap0\"\ndevice = \"driver=virtio-net-pci,netdev=nd0\"\n\n{}",
        pki.peer_table(
            "source",
            None,
            &[
                ("dst", "destination", destination_port),
                ("impostor", "stranger", destination_port),
                ("full", "full", full_port),
            ],
            &[],
        )
    );
    // The destination lets peers name only the VMM its move arrives in (`tm-dst`'s
    // directory), not the peer VM's.
    let arrivals = bed.dir().join("tm-dst");
    let destination_config = format!(
        "[[pool.function]]\nname = \"tap1\"\ndevice = \"driver=virtio-net-pci,netdev=nd0\"\n\n{}",
        pki.peer_table(
            "destination",
            Some(destination_port),
            &[("src", "source", 0)],
            &[arrivals.as_path()]
        )
    );
    // `full` has a pool without a free function.
    let full_config = pki.peer_table("full", Some(full_port), &[("src", "source", 0)], &[]);
    let start = |name: &str, text: &str| {
        let config = write_config(bed.dir(), name, text);
        Daemon::start_named(bed.dir(), name, Some(&config))
            .unwrap_or_else(|e| panic!("{}", error_chain(&e)))
    };
    let source = start("source", &source_config);
    let destination = start("destination", &destination_config);
    let _full = start("full", &full_config);

    let guests = MoveGuests::start(&bed, "tm").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    guests
        .start_flow(TAG, "--mode migratable --rate 200")
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));

    // A wrong certificate: the destination's certificate is not `impostor`'s.
    let (code, stdout, report) = migrate(
        &source,
        &guests,
        &bed.dir().join("impostor.json"),
        &["--destination-migrator", "impostor", "--from-pool"],
    );
    assert_eq!(code, Some(4), "the move was not rolled back");
    assert!(stdout.contains("ROLLED BACK"), "{stdout}");
    assert_eq!(report["failed_phase"], "prepare");
    let error = report["error"].as_str().unwrap();
    assert!(
        error.contains("presented a certificate that is not impostor's"),
        "{error}"
    );
    assert_eq!(phases(&report), ["prepare", "rollback"]);

    // A destination migrator without a free function refuses the reservation.
    let (code, _, report) = migrate(
        &source,
        &guests,
        &bed.dir().join("full.json"),
        &["--destination-migrator", "full", "--from-pool"],
    );
    assert_eq!(code, Some(4), "the move was not rolled back");
    assert_eq!(report["failed_phase"], "prepare");
    let error = report["error"].as_str().unwrap();
    assert!(
        error.contains(&format!(
            "migrator full (127.0.0.1:{full_port}) refused: \
             no free function in the pool"
        )),
        "{error}"
    );
    assert_eq!(phases(&report), ["prepare", "rollback"]);
    assert_eq!(destination.pool_function("tap1")["state"], "free");

    // The source's own credentials, outside its scope: nothing is done.
    refused_outside_scope(&pki, destination_port, &guests);
    let log = std::fs::read_to_string(bed.dir().join("destination-daemon.log")).unwrap();
    let refusals = log
        .lines()
        .filter(|l| l.contains("outside this peer's scope") && l.contains("peer=src"))
        .count();
    assert_eq!(
        refusals, 3,
        "the refusals are not logged with the peer: {log}"
    );

    // hot (by its former name) for a function this host does not have: refused before
    // anything happens.
    let out = migrate_command(source.socket(), &guests.src, &guests.dst)
        .args(["--destination-migrator", "dst", "--from-pool"])
        .args(["--strategy", "vfio-migrate", "--source-function", "tap9"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert_eq!(out.status.code(), Some(3), "hot was not refused");
    assert!(
        stderr.contains("strategy hot refused: function tap9 is not in this host's pool"),
        "{stderr}"
    );
    assert_eq!(destination.pool_function("tap1")["state"], "free");

    // The move, through the destination migrator, with the strategy auto decides.
    let (code, _, report) = migrate(
        &source,
        &guests,
        &bed.dir().join("move.json"),
        &[
            "--destination-migrator",
            "dst",
            "--from-pool",
            "--strategy",
            "auto",
            "--source-function",
            "tap0",
        ],
    );
    let MoveGuests { peer, src, dst } = guests;
    src.kill();
    dst.reattach_console().unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(code, Some(0), "the move failed: {report:#}");
    let (mover, peer_report) = finish_clean_flow(&dst, "moved VM", &peer, TAG);
    // The connection was re-established after the move.
    assert!(mover.connections_established >= 2, "{mover:?}");

    // Both sides say the move is complete: the source's report, the destination's pool.
    assert_eq!(report["final_phase"], "done");
    assert_eq!(report["vm_location"], "destination");
    assert_eq!(report["function"], "tap1");
    let details = |phase: &str| {
        report["timeline"]["phases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["phase"] == phase)
            .unwrap()["details"]
            .clone()
    };
    assert_eq!(
        details("prepare")["destination"],
        format!("migrator dst (127.0.0.1:{destination_port})").as_str()
    );
    assert_eq!(details("attach")["function"], "tap1");
    assert_eq!(report["plan"]["strategy"], "auto");
    assert_eq!(report["chosen"]["strategy"], "reconnect");
    assert_eq!(details("prepare")["strategy"], "reconnect");
    let reason = details("prepare")["strategy_reason"].clone();
    assert_eq!(
        reason,
        "auto picked reconnect: the destination VMM was not asked whether it has the device \
         (another migrator's, or a workflow's): ask for --strategy hot to move it anyway"
    );
    // The destination migrator did each duty for the source, over the channel.
    assert_served_a_move(&bed.dir().join("destination-daemon.log"), "src");
    // The source's function went back to its pool (an emulated NIC has nothing to reset).
    assert_eq!(source.pool_function("tap0")["state"], "free");
    assert_eq!(details("resume")["failed"], 0);
    let state = destination.pool_function("tap1");
    assert_eq!(state["state"], "attached", "{state}");
    assert_eq!(state["vm"], src.spec().name.as_str(), "{state}");
    // The traffic kept flowing after the move: more than the 2 s before it.
    assert!(peer_report.received > 3 * 200, "{peer_report:?}");
}
