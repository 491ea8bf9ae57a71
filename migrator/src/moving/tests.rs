//! The runner's failure paths, against fakes.

use super::*;
use crate::fakes::{FakeBackends, FakeHost, Fault, Where, FAKE_PAUSE};
use crate::journal;
use crate::plan::tests::plan;
use crate::pool::FunctionState;
use crate::unmanaged::Fate;
use rdmamig_proto::agent::UnmanagedProgram;
use rdmamig_vmm::DeviceSpec;

struct Bed {
    host: FakeHost,
    dir: tempfile::TempDir,
    pool: Arc<Pool>,
}

impl Bed {
    /// A fake host whose pool has `functions` emulated functions `tap0`...
    fn with_pool(functions: usize) -> Bed {
        let dir = tempfile::tempdir().unwrap();
        let mut text = String::new();
        for i in 0..functions {
            text.push_str(&format!(
                "[[pool.function]]\nname = \"tap{i}\"\ndevice = \"driver=e1000e,netdev=nd{i}\"\n"
            ));
        }
        let config: crate::config::Config = toml::from_str(&text).unwrap();
        let pool = Pool::open(&config.pool, &dir.path().join("pool.json")).unwrap();
        Bed {
            host: FakeHost::new(),
            dir,
            pool: Arc::new(pool),
        }
    }

    fn new() -> Bed {
        Bed::with_pool(0)
    }

    fn pooled() -> MovePlan {
        let mut plan = plan();
        plan.from_pool = true;
        plan
    }

    fn context(&self, boundary: Option<BoundaryHook>) -> MoveContext {
        MoveContext {
            backends: Arc::new(FakeBackends(self.host.clone())),
            pool: self.pool.clone(),
            peers: None,
            boundary,
        }
    }

    async fn run(&self, plan: MovePlan) -> MoveReport {
        let journal = Journal::create(self.dir.path(), "m", &plan).unwrap();
        let (events, _received) = tokio::sync::mpsc::unbounded_channel();
        run_move(
            "m".into(),
            plan.clone(),
            Choice::asked(plan.strategy),
            journal,
            self.context(None),
            events,
        )
        .await
    }

    fn journal_path(&self) -> std::path::PathBuf {
        self.dir.path().join("m.journal")
    }

    fn calls(&self) -> Vec<String> {
        self.host.state().calls.clone()
    }
}

/// The VM is back on the source with a device, running, connections resumed there.
fn assert_back_on_source(bed: &Bed, report: &MoveReport, resumed: bool) {
    assert_eq!(report.final_phase, Phase::RolledBack, "{report:#?}");
    assert!(!report.ok);
    assert_eq!(report.vm_location, VmLocation::Source);
    assert!(report.error.is_some());
    let state = bed.host.state();
    assert_eq!(state.guest, Where::Source);
    assert_eq!(state.source_state, "running");
    assert!(!state.migrating);
    assert!(
        !state.source_devices.is_empty(),
        "{:?}",
        state.source_devices
    );
    assert_eq!(state.resumed_on.last() == Some(&Where::Source), resumed);
    assert!(!state.quiesced);
    let rollback = report.timeline.phases.last().unwrap();
    assert_eq!(rollback.phase, Phase::Rollback);
    assert_eq!(rollback.outcome, PhaseOutcome::Ok);
    let replay = journal::read(&bed.journal_path()).unwrap();
    assert_eq!(replay.ended(), Some(Phase::RolledBack));
    assert!(replay.rolling_back().is_some());
}

#[tokio::test]
async fn default_deadlines_grow_with_the_listed_connections_and_set_ones_stay() {
    let bed = Bed::new();
    let mut asked = plan();
    asked.deadlines.set("quiesce=3000").unwrap();
    let report = bed.run(asked).await;
    assert!(report.ok, "{report:#?}");
    let deadline = |phase: Phase| report.timeline.phase(phase).map(|p| p.deadline_ms);
    // The fake guest lists two connections.
    assert_eq!(deadline(Phase::Prepare), Some(10_000), "prepare lists them");
    assert_eq!(deadline(Phase::Quiesce), Some(3_000), "set by the client");
    assert_eq!(deadline(Phase::Detach), Some(5_000 + 2 * 200));
    assert_eq!(deadline(Phase::Migrate), Some(60_000));
    assert_eq!(deadline(Phase::Resume), Some(20_000 + 2 * 250));
}

#[tokio::test]
async fn a_move_runs_every_phase_and_journals_each_before_it_acts() {
    let bed = Bed::new();
    let report = bed.run(plan()).await;
    assert!(report.ok, "{report:#?}");
    assert_eq!(report.final_phase, Phase::Done);
    assert_eq!(report.vm_location, VmLocation::Destination);
    assert!(report.forced.is_empty());
    let phases: Vec<Phase> = report.timeline.phases.iter().map(|p| p.phase).collect();
    assert_eq!(phases, Phase::WORKING);
    let migrate = &report.timeline.phases[3].details;
    assert_eq!(migrate["vm_paused_ms"], millis(FAKE_PAUSE));
    assert_eq!(migrate["downtime_ms"], 20);
    let state = bed.host.state();
    assert_eq!(state.destination_devices, ["nic1".to_string()].into());
    assert_eq!(state.resumed_on, vec![Where::Destination]);
    let replay = journal::read(&bed.journal_path()).unwrap();
    let entered: Vec<Phase> = replay
        .records
        .iter()
        .filter_map(|r| match r {
            Record::Enter { phase } => Some(*phase),
            _ => None,
        })
        .collect();
    assert_eq!(entered, Phase::WORKING);
    assert_eq!(replay.connections(), vec![11, 12]);
    assert!(replay.migrated());
    assert_eq!(replay.ended(), Some(Phase::Done));
}

#[tokio::test]
async fn prepare_failure_rolls_back_with_nothing_to_undo() {
    let bed = Bed::new();
    bed.host.state().destination_state = "running".into();
    let report = bed.run(plan()).await;
    assert_back_on_source(&bed, &report, false);
    assert_eq!(report.failed_phase, Some(Phase::Prepare));
    assert!(report.error.as_deref().unwrap().contains("-incoming defer"));
    assert!(!bed.calls().iter().any(|c| c.starts_with("agent.quiesce")));
    assert!(bed.host.state().source_devices.contains("nic0"));
}

#[tokio::test]
async fn a_silent_agent_at_prepare_rolls_back() {
    let bed = Bed::new();
    bed.host.fail("agent.ping", Fault::Timeout);
    let mut plan = plan();
    plan.deadlines.set("prepare=300").unwrap();
    let report = bed.run(plan).await;
    assert_back_on_source(&bed, &report, false);
    assert_eq!(report.failed_phase, Some(Phase::Prepare));
}

#[tokio::test]
async fn a_silent_agent_at_quiesce_takes_the_forced_path_and_the_move_goes_on() {
    let bed = Bed::new();
    bed.host.fail("agent.quiesce", Fault::Timeout);
    let report = bed.run(plan()).await;
    assert!(report.ok, "{report:#?}");
    assert_eq!(report.forced.len(), 1);
    assert_eq!(report.forced[0].phase, Phase::Quiesce);
    assert!(report.forced[0].reason.contains("did not answer quiesce"));
    assert!(matches!(
        report.timeline.phases[1].outcome,
        PhaseOutcome::Forced { .. }
    ));
}

#[tokio::test]
async fn an_agent_lost_at_quiesce_and_silent_at_resume_forces_both_and_the_move_is_done() {
    let bed = Bed::new();
    bed.host.fail("agent.quiesce", Fault::Timeout);
    bed.host.fail("agent.resume", Fault::Timeout);
    let report = bed.run(plan()).await;
    assert!(report.ok, "{report:#?}");
    assert_eq!(report.vm_location, VmLocation::Destination);
    let forced: Vec<Phase> = report.forced.iter().map(|f| f.phase).collect();
    assert_eq!(forced, [Phase::Quiesce, Phase::Resume]);
    assert!(report.forced[1].reason.contains("library's own path"));
    assert!(matches!(
        report.timeline.phases[5].outcome,
        PhaseOutcome::Forced { .. }
    ));
}

#[tokio::test]
async fn a_peer_that_does_not_ack_the_pause_is_forced_and_recorded() {
    let bed = Bed::new();
    bed.host.fail("agent.quiesce", Fault::PeerNoAck);
    let report = bed.run(plan()).await;
    assert!(report.ok, "{report:#?}");
    assert_eq!(report.forced.len(), 1);
    assert!(report.forced[0]
        .reason
        .contains("did not acknowledge the PAUSE"));
    assert_eq!(report.quiesce.iter().filter(|o| !o.ok).count(), 1);
}

#[tokio::test]
async fn a_held_device_context_rolls_back_after_the_pending_unplug_completes() {
    let bed = Bed::new();
    bed.host.fail("src.remove_device", Fault::Timeout);
    // The holder lets go a few checks into the rollback: the guest then finishes the
    // unplug it was asked for, and the VM would have no NIC if nothing were plugged.
    bed.host.state().holder_lets_go_after = Some(3);
    let report = bed.run(plan()).await;
    assert_back_on_source(&bed, &report, true);
    assert_eq!(report.failed_phase, Some(Phase::Detach));
    assert_eq!(report.forced[0].phase, Phase::Detach);
    let state = bed.host.state();
    assert_eq!(state.unplug_pending, None);
    assert!(state
        .source_devices
        .contains(plan().reattach_spec().unwrap().id()));
    let calls = &state.calls;
    let added = calls.iter().position(|c| c == "src.add_device").unwrap();
    let resumed = calls.iter().rposition(|c| c == "agent.resume").unwrap();
    assert!(added < resumed, "{calls:?}");
    let steps = &report.timeline.phases.last().unwrap().details["steps"];
    let steps: Vec<&str> = steps
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s.as_str())
        .collect();
    assert!(
        steps[0].starts_with("waited ") && steps[0].contains("removing device nic0"),
        "{steps:?}"
    );
    assert!(steps[1].contains("re-attached on the source"), "{steps:?}");
}

#[tokio::test]
async fn a_device_the_guest_never_lets_go_fails_the_rollback_and_says_so() {
    let bed = Bed::new();
    bed.host.fail("src.remove_device", Fault::Timeout);
    let mut plan = plan();
    plan.deadlines.set("rollback=300").unwrap();
    let report = bed.run(plan).await;
    assert_eq!(report.final_phase, Phase::Failed, "{report:#?}");
    let error = report.rollback_error.as_deref().unwrap();
    assert!(
        error.contains("has not finished removing device nic0 after")
            && error.contains("then has none"),
        "{error}"
    );
    // Nothing was plugged beside the device whose removal is pending.
    assert!(!bed.calls().contains(&"src.add_device".to_string()));
}

#[tokio::test]
async fn a_held_device_context_is_released_by_force_when_the_move_allows_it() {
    let bed = Bed::new();
    bed.host.fail("src.remove_device", Fault::Timeout);
    let mut plan = plan();
    plan.unmanaged = Some(UnmanagedPolicy::Release);
    let report = bed.run(plan).await;
    assert!(report.ok, "{report:#?}");
    assert_eq!(report.forced.len(), 1);
    assert_eq!(report.forced[0].phase, Phase::Detach);
    let reason = &report.forced[0].reason;
    assert!(
        reason
            .contains("forced release (--unmanaged release): PID 4242 (ibv_rc_pingpong): SIGTERM"),
        "{reason}"
    );
    let detach = &report.timeline.phases[2];
    assert!(matches!(detach.outcome, PhaseOutcome::Forced { .. }));
    assert_eq!(detach.details["forced_release"][0]["pid"], 4242);
    let calls = bed.calls();
    let unplugs = calls.iter().filter(|c| *c == "src.remove_device").count();
    assert_eq!(unplugs, 2, "{calls:?}");
    assert!(calls.contains(&"agent.release_device".to_string()));
}

#[tokio::test]
async fn a_failed_forced_release_rolls_back() {
    let bed = Bed::new();
    bed.host.fail("src.remove_device", Fault::Timeout);
    bed.host.fail("agent.release_device", Fault::Timeout);
    let mut plan = plan();
    plan.unmanaged = Some(UnmanagedPolicy::Release);
    // The holder ends on its own a little later; the rollback waits for the removal.
    bed.host.state().holder_lets_go_after = Some(2);
    let report = bed.run(plan).await;
    assert_back_on_source(&bed, &report, true);
    assert_eq!(report.failed_phase, Some(Phase::Detach));
}

fn rping(pid: u32) -> UnmanagedProgram {
    UnmanagedProgram {
        pid,
        command: "rping -c -a 10.77.0.3".into(),
        devices: vec!["rdma_cm".into()],
        open_context: false,
    }
}

#[tokio::test]
async fn unmanaged_programs_refuse_the_move_at_prepare_by_default() {
    let bed = Bed::new();
    bed.host.state().unmanaged = vec![rping(31)];
    let report = bed.run(plan()).await;
    assert_eq!(report.final_phase, Phase::RolledBack, "{report:#?}");
    assert_eq!(report.failed_phase, Some(Phase::Prepare));
    let error = report.error.as_deref().unwrap();
    assert!(
        error.contains("PID 31 (rping -c -a 10.77.0.3) on rdma_cm")
            && error.contains("--unmanaged release"),
        "{error}"
    );
    assert_eq!(report.unmanaged.len(), 1);
    assert_eq!(report.unmanaged[0].fate, Fate::Untouched);
    assert_eq!(report.casualties().count(), 0);
    let calls = bed.calls();
    // Nothing changed: no quiesce, no unplug, and the destination was not readied.
    for call in [
        "agent.quiesce",
        "src.remove_device",
        "agent.release_device",
        "dst.prepare_incoming",
    ] {
        assert!(!calls.contains(&call.to_string()), "{call}: {calls:?}");
    }
}

#[tokio::test]
async fn release_ends_unmanaged_programs_before_the_unplug() {
    let bed = Bed::new();
    bed.host.state().unmanaged = vec![rping(31)];
    let mut plan = plan();
    plan.unmanaged = Some(UnmanagedPolicy::Release);
    let report = bed.run(plan).await;
    assert!(report.ok, "{report:#?}");
    assert_eq!(report.unmanaged[0].fate, Fate::Ended);
    assert_eq!(report.unmanaged[0].action.as_deref(), Some("SIGTERM"));
    assert!(report.forced.is_empty(), "{:?}", report.forced);
    let calls = bed.calls();
    let release = calls.iter().position(|c| c == "agent.release_device");
    let unplug = calls.iter().position(|c| c == "src.remove_device");
    assert!(release.unwrap() < unplug.unwrap(), "{calls:?}");
    let detach = &report.timeline.phases[2];
    assert_eq!(detach.details["ended"][0]["pid"], 31);
}

#[tokio::test]
async fn ignore_moves_and_marks_unmanaged_programs_broken() {
    let bed = Bed::new();
    bed.host.state().unmanaged = vec![rping(31)];
    let mut plan = plan();
    plan.unmanaged = Some(UnmanagedPolicy::Ignore);
    let report = bed.run(plan).await;
    assert!(report.ok, "{report:#?}");
    assert_eq!(report.unmanaged[0].fate, Fate::Broken);
    assert_eq!(report.casualties().count(), 1);
    assert!(!bed.calls().contains(&"agent.release_device".to_string()));
}

#[tokio::test]
async fn a_program_started_after_prepare_rolls_back_before_the_unplug() {
    let bed = Bed::new();
    let host = bed.host.clone();
    let boundary: BoundaryHook = Arc::new(move |phase| {
        if phase == Phase::Quiesce {
            host.state().unmanaged = vec![rping(32)];
        }
    });
    let plan = plan();
    let journal = Journal::create(bed.dir.path(), "m", &plan).unwrap();
    let (events, _received) = tokio::sync::mpsc::unbounded_channel();
    let report = run_move(
        "m".into(),
        plan.clone(),
        Choice::asked(plan.strategy),
        journal,
        bed.context(Some(boundary)),
        events,
    )
    .await;
    assert_back_on_source(&bed, &report, true);
    assert_eq!(report.failed_phase, Some(Phase::Detach));
    let error = report.error.as_deref().unwrap();
    assert!(
        error.contains("started since prepare") && error.contains("PID 32"),
        "{error}"
    );
    assert!(!bed.calls().contains(&"src.remove_device".to_string()));
    assert_eq!(report.unmanaged[0].fate, Fate::Untouched);
}

#[tokio::test]
async fn a_stalled_migration_is_cancelled_and_rolled_back() {
    let bed = Bed::new();
    bed.host.fail("src.wait_migration", Fault::Timeout);
    let report = bed.run(plan()).await;
    assert_back_on_source(&bed, &report, true);
    assert_eq!(report.failed_phase, Some(Phase::Migrate));
    assert_eq!(report.forced[0].phase, Phase::Migrate);
    let calls = bed.calls();
    assert!(calls.contains(&"src.cancel_migration".to_string()));
    assert!(calls.contains(&"src.add_device".to_string()));
    assert_eq!(bed.host.state().source_devices, ["nic1".to_string()].into());
}

#[tokio::test]
async fn a_failed_migration_rolls_back() {
    let bed = Bed::new();
    bed.host.fail("src.wait_migration", Fault::Refuse);
    let report = bed.run(plan()).await;
    assert_back_on_source(&bed, &report, true);
    assert!(report.forced.is_empty());
    assert!(report.error.as_deref().unwrap().contains("failed on cue"));
}

#[tokio::test]
async fn an_attach_failure_after_the_migration_fails_back_to_the_source() {
    let bed = Bed::new();
    bed.host.fail("dst.add_device", Fault::Refuse);
    let report = bed.run(plan()).await;
    assert_back_on_source(&bed, &report, true);
    assert_eq!(report.failed_phase, Some(Phase::Attach));
    let state = bed.host.state();
    assert!(state.destination_gone);
    assert!(state.calls.contains(&"src.resume".to_string()));
    let steps = &report.timeline.phases.last().unwrap().details["steps"];
    assert!(
        steps.to_string().contains("destination VMM stopped"),
        "{steps}"
    );
}

#[tokio::test]
async fn a_migration_the_destination_did_not_receive_fails_back_to_the_source() {
    let bed = Bed::new();
    bed.host.fail("dst.confirm_received", Fault::Refuse);
    let report = bed.run(plan()).await;
    assert_back_on_source(&bed, &report, true);
    assert_eq!(report.failed_phase, Some(Phase::Migrate));
    let state = bed.host.state();
    assert!(state.destination_gone);
    assert_eq!(state.source_state, "running");
    assert!(
        !state.calls.contains(&"dst.add_device".to_string()),
        "nothing is plugged into a VM that did not arrive"
    );
    assert!(
        report
            .error
            .as_deref()
            .unwrap_or("")
            .contains("not received"),
        "{report:?}"
    );
}

#[tokio::test]
async fn a_resume_failure_is_past_the_point_of_no_return() {
    let bed = Bed::new();
    bed.host.fail("agent.resume", Fault::Timeout);
    let report = bed.run(plan()).await;
    assert_eq!(report.final_phase, Phase::Failed);
    assert_eq!(report.failed_phase, Some(Phase::Resume));
    assert_eq!(report.vm_location, VmLocation::Destination);
    assert!(report.rollback_error.is_none());
    assert!(!report
        .timeline
        .phases
        .iter()
        .any(|p| p.phase == Phase::Rollback));
    let replay = journal::read(&bed.journal_path()).unwrap();
    assert_eq!(replay.ended(), Some(Phase::Failed));
}

#[tokio::test]
async fn a_failed_rollback_ends_failed_and_says_why() {
    let bed = Bed::new();
    bed.host.fail("src.wait_migration", Fault::Refuse);
    bed.host.fail("src.add_device", Fault::Refuse);
    let report = bed.run(plan()).await;
    assert_eq!(report.final_phase, Phase::Failed);
    assert_eq!(report.failed_phase, Some(Phase::Migrate));
    assert!(report
        .rollback_error
        .as_deref()
        .unwrap()
        .contains("refused on cue"));
    assert_eq!(report.vm_location, VmLocation::Source);
}

/// Kills the move (a panic in the boundary hook, the way the daemon aborts) right after
/// `phase` was journaled, then recovers it from the journal.
async fn crash_and_recover(bed: &Bed, plan: MovePlan, crash_at: Phase) -> MoveReport {
    let journal = Journal::create(bed.dir.path(), "m", &plan).unwrap();
    let hook: BoundaryHook = Arc::new(move |phase| {
        assert!(phase != crash_at, "killed at {phase}");
    });
    let (events, _received) = tokio::sync::mpsc::unbounded_channel();
    let context = bed.context(Some(hook));
    let killed = tokio::spawn(run_move(
        "m".into(),
        plan.clone(),
        Choice::asked(plan.strategy),
        journal,
        context,
        events,
    ))
    .await;
    assert!(killed.is_err(), "the move was not killed at {crash_at}");
    let open = journal::scan(bed.dir.path()).unwrap().unfinished;
    assert_eq!(open.len(), 1);
    let (path, replay) = open.into_iter().next().unwrap();
    let (events, _received) = tokio::sync::mpsc::unbounded_channel();
    let report = recover(
        replay,
        Journal::reopen(&path).unwrap(),
        bed.context(None),
        events,
    )
    .await;
    assert!(journal::scan(bed.dir.path()).unwrap().unfinished.is_empty());
    report
}

#[tokio::test]
async fn a_migrator_killed_at_every_phase_boundary_finishes_or_rolls_back() {
    for crash_at in Phase::WORKING {
        let bed = Bed::new();
        let report = crash_and_recover(&bed, plan(), crash_at).await;
        assert_eq!(report.recovered_from, Some(crash_at), "{crash_at}");
        if crash_at <= Phase::Migrate {
            // Killed before the migration: back to the source.
            assert_back_on_source(&bed, &report, crash_at >= Phase::Quiesce);
            assert!(report.error.as_deref().unwrap().contains("restarted"));
        } else {
            assert!(report.ok, "{crash_at}: {report:#?}");
            let state = bed.host.state();
            assert_eq!(state.guest, Where::Destination);
            assert_eq!(state.destination_devices, ["nic1".to_string()].into());
            assert_eq!(state.resumed_on.last(), Some(&Where::Destination));
        }
    }
}

#[tokio::test]
async fn a_migrator_killed_during_a_rollback_finishes_it() {
    let bed = Bed::new();
    bed.host.fail("dst.add_device", Fault::Refuse);
    let report = crash_and_recover(&bed, plan(), Phase::Rollback).await;
    assert_back_on_source(&bed, &report, true);
    assert!(bed.host.state().destination_gone);
}

#[tokio::test]
async fn a_migration_that_completed_before_the_journal_said_so_is_finished() {
    let bed = Bed::new();
    let plan = plan();
    let mut journal = Journal::create(bed.dir.path(), "m", &plan).unwrap();
    for phase in [
        Phase::Prepare,
        Phase::Quiesce,
        Phase::Detach,
        Phase::Migrate,
    ] {
        journal.append(&Record::Enter { phase }).unwrap();
    }
    {
        let mut state = bed.host.state();
        state.source_devices.clear();
        state.source_state = "postmigrate".into();
        state.destination_state = "running".into();
        state.guest = Where::Destination;
        state.quiesced = true;
    }
    let replay = journal::read(&bed.journal_path()).unwrap();
    let (events, _received) = tokio::sync::mpsc::unbounded_channel();
    let report = recover(replay, journal, bed.context(None), events).await;
    assert!(report.ok, "{report:#?}");
    assert_eq!(report.vm_location, VmLocation::Destination);
    assert_eq!(bed.host.state().resumed_on, vec![Where::Destination]);
}

#[tokio::test]
async fn a_pooled_function_is_reserved_then_attached() {
    let bed = Bed::with_pool(1);
    let report = bed.run(Bed::pooled()).await;
    assert!(report.ok, "{report:#?}");
    assert_eq!(report.function.as_deref(), Some("tap0"));
    assert_eq!(
        bed.pool.state("tap0"),
        Some(FunctionState::Attached { vm: "vm1".into() })
    );
    let attach = &report.timeline.phases[4];
    assert_eq!(attach.details["driver"], "e1000e");
}

#[tokio::test]
async fn no_free_function_rolls_back_at_prepare_before_touching_the_vm() {
    let bed = Bed::with_pool(0);
    let report = bed.run(Bed::pooled()).await;
    assert_back_on_source(&bed, &report, false);
    assert_eq!(report.failed_phase, Some(Phase::Prepare));
    assert!(report
        .error
        .as_deref()
        .unwrap()
        .contains("no free function in the pool"));
    assert!(bed.calls().is_empty(), "{:?}", bed.calls());
}

#[tokio::test]
async fn a_rollback_releases_the_reservation() {
    for fault in ["src.wait_migration", "dst.add_device"] {
        let bed = Bed::with_pool(1);
        bed.host.fail(fault, Fault::Refuse);
        let report = bed.run(Bed::pooled()).await;
        assert_back_on_source(&bed, &report, true);
        assert_eq!(bed.pool.state("tap0"), Some(FunctionState::Free), "{fault}");
        let steps = &report.timeline.phases.last().unwrap().details["steps"];
        assert!(steps.to_string().contains("tap0 released"), "{steps}");
    }
}

#[tokio::test]
async fn a_reservation_survives_a_killed_migrator_and_the_recovery_uses_it() {
    let bed = Bed::with_pool(1);
    let report = crash_and_recover(&bed, Bed::pooled(), Phase::Attach).await;
    assert!(report.ok, "{report:#?}");
    assert_eq!(
        bed.pool.state("tap0"),
        Some(FunctionState::Attached { vm: "vm1".into() })
    );
    let bed = Bed::with_pool(1);
    let report = crash_and_recover(&bed, Bed::pooled(), Phase::Detach).await;
    assert_eq!(report.final_phase, Phase::RolledBack);
    assert_eq!(bed.pool.state("tap0"), Some(FunctionState::Free));
}

#[tokio::test]
async fn the_detached_function_is_reset_then_returned_or_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let config: crate::config::Config = toml::from_str(
        "[[pool.function]]\nname = \"tap0\"\ndevice = \"driver=e1000e,netdev=nd0\"\n\
         [[pool.function]]\nname = \"vf9\"\npci = \"0000:3b:00.7\"\n",
    )
    .unwrap();
    for (function, freed) in [("tap0", true), ("vf9", false)] {
        let mut bed = Bed::new();
        bed.pool = Arc::new(
            Pool::open(&config.pool, &dir.path().join(format!("{function}.json"))).unwrap(),
        );
        // The source VM runs with the function, as an earlier move left it.
        bed.pool.reserve("earlier").unwrap();
        bed.pool.reserve("earlier").unwrap();
        bed.pool.attach(function, "earlier", "vm1").unwrap();
        let mut plan = plan();
        plan.source_function = Some(function.into());
        let report = bed.run(plan).await;
        assert!(report.ok, "{report:#?}");
        let reset = report.timeline.phases[2].details["reset"].as_str().unwrap();
        let state = bed.pool.state(function).unwrap();
        if freed {
            assert_eq!(reset, "emulated: nothing to reset");
            assert_eq!(state, FunctionState::Free);
        } else {
            // This host has no such VF (and maybe no VFIO): the reset fails, and the
            // function must not be handed out again.
            assert!(reset.starts_with("FAILED: "), "{reset}");
            assert!(
                matches!(&state, FunctionState::Quarantined { reason } if !reason.is_empty()),
                "{state:?}"
            );
        }
    }
}

#[tokio::test]
async fn a_rollback_plugs_the_source_vf_back_by_its_pci_address() {
    let dir = tempfile::tempdir().unwrap();
    let config: crate::config::Config =
        toml::from_str("[[pool.function]]\nname = \"vf9\"\npci = \"0000:3b:00.7\"\n").unwrap();
    let mut bed = Bed::new();
    bed.pool = Arc::new(Pool::open(&config.pool, &dir.path().join("pool.json")).unwrap());
    bed.pool.reserve("earlier").unwrap();
    bed.pool.attach("vf9", "earlier", "vm1").unwrap();
    bed.host.fail("src.wait_migration", Fault::Refuse);
    let mut plan = plan();
    plan.source_function = Some("vf9".into());
    // As for a VF from the destination's pool: --attach gives id, bus and MAC, no host.
    plan.attach =
        Some(DeviceSpec::parse("driver=vfio-pci,id=nic0,bus=rp1,mac=52:54:00:77:00:65").unwrap());
    let report = bed.run(plan).await;
    assert_back_on_source(&bed, &report, true);
    let state = bed.host.state();
    let (side, device) = state.plugged.last().unwrap();
    assert_eq!(*side, Where::Source);
    let properties = device.properties();
    assert_eq!(properties["driver"], "vfio-pci");
    assert_eq!(properties["host"], "0000:3b:00.7");
    assert_eq!(properties["id"], "nic0");
    assert!(!properties.contains_key("mac"), "{properties:?}");
}

#[tokio::test]
async fn a_move_that_fails_past_the_point_of_no_return_still_frees_the_source_function() {
    let dir = tempfile::tempdir().unwrap();
    let config: crate::config::Config = toml::from_str(
        "[[pool.function]]\nname = \"tap0\"\ndevice = \"driver=e1000e,netdev=nd0\"\n",
    )
    .unwrap();
    let mut bed = Bed::new();
    bed.pool = Arc::new(Pool::open(&config.pool, &dir.path().join("pool.json")).unwrap());
    bed.pool.reserve("earlier").unwrap();
    bed.pool.attach("tap0", "earlier", "vm1").unwrap();
    bed.host.fail("agent.resume", Fault::Timeout);
    let mut plan = plan();
    plan.source_function = Some("tap0".into());
    let report = bed.run(plan).await;
    assert_eq!(report.final_phase, Phase::Failed);
    assert_eq!(report.vm_location, VmLocation::Destination);
    assert_eq!(bed.pool.state("tap0"), Some(FunctionState::Free));
}

#[tokio::test]
async fn the_naive_strategy_rolls_back_without_the_agent() {
    let bed = Bed::new();
    bed.host.fail("src.wait_migration", Fault::Refuse);
    let mut plan = plan();
    plan.strategy = Strategy::Naive;
    let report = bed.run(plan).await;
    assert_back_on_source(&bed, &report, false);
    assert!(!bed.calls().iter().any(|c| c.starts_with("agent.")));
}

/// A workflow's move: the plan `pre-migrate` makes (no destination, no device to attach,
/// the NIC to plug back named).
fn workflow_plan() -> MovePlan {
    let mut plan = plan();
    plan.migration = MigrationBy::Workflow;
    plan.reattach = plan.attach.take();
    plan.destination = None;
    plan.via = String::new();
    plan
}

impl Bed {
    /// Runs `pre-migrate`'s half of a workflow's move.
    async fn hand_over(&self) -> MoveReport {
        self.hand_over_plan(workflow_plan()).await
    }

    /// Runs `pre-migrate`'s half of the workflow's move `plan`.
    async fn hand_over_plan(&self, plan: MovePlan) -> MoveReport {
        plan.validate().unwrap();
        let journal = Journal::create(self.dir.path(), "m", &plan).unwrap();
        let (events, _received) = tokio::sync::mpsc::unbounded_channel();
        let choice = Choice::asked(plan.strategy);
        run_to_handover(
            "m".into(),
            plan,
            choice,
            journal,
            self.context(None),
            events,
        )
        .await
    }

    /// What the workflow does between the hooks: the VM migrates.
    fn workflow_migrates(&self) {
        let mut state = self.host.state();
        state.source_state = "postmigrate".into();
        state.destination_state = "running".into();
        state.guest = Where::Destination;
    }

    /// Runs `post-migrate`'s half, with the hand-over's report.
    async fn go_on(&self, earlier: MoveReport) -> Result<MoveReport, HandoverError> {
        let replay = journal::read(&self.journal_path()).unwrap();
        let journal = Journal::reopen(&self.journal_path()).unwrap();
        let (events, _received) = tokio::sync::mpsc::unbounded_channel();
        let full = plan();
        run_after_handover(
            replay,
            journal,
            full.destination.unwrap(),
            full.attach.unwrap(),
            Some(earlier),
            self.context(None),
            events,
        )
        .await
    }
}

#[tokio::test]
async fn a_workflows_move_is_one_journaled_move_across_both_hooks() {
    let bed = Bed::new();
    let handed = bed.hand_over().await;
    assert!(handed.ok, "{handed:#?}");
    assert_eq!(handed.final_phase, Phase::Detach);
    let replay = journal::read(&bed.journal_path()).unwrap();
    assert_eq!(replay.handed_over(), Some(this_host().as_str()));
    assert_eq!(replay.ended(), None);
    assert!(!bed.calls().contains(&"src.send_migration".to_string()));
    assert!(
        !bed.calls().iter().any(|c| c.starts_with("dst.")),
        "{:?}",
        bed.calls()
    );
    bed.workflow_migrates();
    let report = bed.go_on(handed).await.unwrap();
    assert!(report.ok, "{report:#?}");
    assert_eq!(report.final_phase, Phase::Done);
    let phases: Vec<Phase> = report.timeline.phases.iter().map(|p| p.phase).collect();
    assert_eq!(
        phases,
        Phase::WORKING,
        "the report holds both hooks' phases"
    );
    assert_eq!(report.connections.len(), 2);
    assert_eq!(report.timeline.phases[3].details["migrated_by"], "workflow");
    assert!(!bed.calls().contains(&"src.send_migration".to_string()));
    {
        let state = bed.host.state();
        assert_eq!(state.resumed_on, vec![Where::Destination]);
        assert_eq!(state.destination_devices, ["nic1".to_string()].into());
    }
    let replay = journal::read(&bed.journal_path()).unwrap();
    assert_eq!(replay.ended(), Some(Phase::Done));
    assert_eq!(
        replay.plan.destination,
        plan().destination,
        "the arrival is journaled"
    );
    // The move has ended: a second post-migrate changes nothing.
    let again = bed.go_on(report).await.unwrap_err();
    assert!(matches!(again, HandoverError::Ended { .. }), "{again}");
}

#[tokio::test]
async fn a_workflows_move_whose_attach_fails_rolls_back_to_the_source() {
    let bed = Bed::new();
    let handed = bed.hand_over().await;
    assert!(handed.ok, "{handed:#?}");
    bed.workflow_migrates();
    bed.host.fail("dst.add_device", Fault::Refuse);
    let report = bed.go_on(handed).await.unwrap();
    assert_eq!(report.failed_phase, Some(Phase::Attach));
    assert_back_on_source(&bed, &report, true);
    let state = bed.host.state();
    assert!(
        state.destination_gone,
        "the destination's copy was not discarded"
    );
    assert!(
        state.source_devices.contains("nic1"),
        "{:?}",
        state.source_devices
    );
}

#[tokio::test]
async fn a_workflows_move_refused_at_prepare_ends_without_a_hand_over() {
    let bed = Bed::new();
    bed.host.state().unmanaged = vec![rping(7)];
    let handed = bed.hand_over().await;
    assert!(!handed.ok);
    assert_eq!(handed.final_phase, Phase::RolledBack);
    assert!(!bed.calls().contains(&"src.remove_device".to_string()));
    let replay = journal::read(&bed.journal_path()).unwrap();
    assert_eq!(replay.handed_over(), None);
    let refused = bed.go_on(handed).await.unwrap_err();
    assert!(matches!(refused, HandoverError::Ended { .. }), "{refused}");
}

#[tokio::test]
async fn a_move_that_was_not_handed_over_is_not_gone_on_with() {
    let bed = Bed::new();
    let daemon_plan = plan();
    Journal::create(bed.dir.path(), "m", &daemon_plan).unwrap();
    let earlier = Bed::new().hand_over().await;
    let refused = bed.go_on(earlier).await.unwrap_err();
    assert!(
        matches!(refused, HandoverError::NotAWorkflowMove { .. }),
        "{refused}"
    );
    assert!(bed.calls().is_empty(), "{:?}", bed.calls());
}

#[tokio::test]
async fn a_post_migrate_on_another_host_never_takes_its_own_vmm_for_the_source() {
    let bed = Bed::new();
    let handed = bed.hand_over().await;
    assert!(handed.ok, "{handed:#?}");
    // The journal came from another host: its source socket path means nothing here.
    let text = std::fs::read_to_string(bed.journal_path()).unwrap();
    let here = format!("\"host\":{}", serde_json::to_string(&this_host()).unwrap());
    std::fs::write(
        bed.journal_path(),
        text.replace(&here, "\"host\":\"elsewhere\""),
    )
    .unwrap();
    bed.workflow_migrates();
    bed.host.fail("dst.add_device", Fault::Refuse);
    let calls_before = bed.calls().len();
    let report = bed.go_on(handed).await.unwrap();
    assert_eq!(report.final_phase, Phase::Failed);
    let rollback = report.rollback_error.as_deref().unwrap_or_default();
    assert!(rollback.contains("on host elsewhere"), "{rollback}");
    let calls = bed.calls();
    assert!(
        !calls[calls_before..].iter().any(|c| c.starts_with("src.")),
        "the source was touched: {calls:?}"
    );
}

#[tokio::test]
async fn a_connection_the_agent_leaves_out_of_its_quiesce_answer_was_not_quiesced() {
    let bed = Bed::new();
    bed.host.fail("agent.quiesce", Fault::LeavesOut);
    let report = bed.run(plan()).await;
    assert!(report.ok, "{report:#?}");
    let left_out = report.quiesce.iter().find(|o| o.id == 12).unwrap();
    assert!(!left_out.ok, "{left_out:?}");
    assert!(
        left_out.error.as_deref().unwrap().contains("left it out"),
        "{left_out:?}"
    );
    assert_eq!(report.forced.len(), 1, "{:?}", report.forced);
    assert_eq!(report.forced[0].phase, Phase::Quiesce);
    let quiesce = &report.timeline.phases[1];
    assert_eq!(quiesce.details["failed"], 1);
    assert!(matches!(quiesce.outcome, PhaseOutcome::Forced { .. }));
}

#[tokio::test]
async fn a_hot_move_pauses_while_the_switchover_is_held_and_swaps_nothing() {
    let bed = Bed::new();
    let mut asked = plan();
    asked.strategy = Strategy::Hot;
    let report = bed.run(asked).await;
    assert!(report.ok, "{report:#?}");
    let outcome = |phase: Phase| {
        report
            .timeline
            .phase(phase)
            .map(|p| p.outcome.clone())
            .unwrap()
    };
    for phase in [Phase::Quiesce, Phase::Detach, Phase::Attach] {
        assert!(
            matches!(outcome(phase), PhaseOutcome::Skipped { .. }),
            "{phase}: {:?}",
            outcome(phase)
        );
    }
    assert_eq!(outcome(Phase::Resume), PhaseOutcome::Ok);
    let migrate = &report.timeline.phases[3].details;
    assert_eq!(migrate["paused"], 2, "{migrate:#?}");
    assert_eq!(migrate["switchover"], "held until the pause");
    // The pause comes between the hold and the release, and nothing is plugged or
    // unplugged.
    let calls = bed.calls();
    let at = |name: &str| {
        calls
            .iter()
            .position(|c| c == name)
            .unwrap_or_else(|| panic!("no {name} in {calls:?}"))
    };
    assert!(at("src.hold_switchover") < at("agent.quiesce"), "{calls:?}");
    assert!(
        at("agent.quiesce") < at("src.release_switchover"),
        "{calls:?}"
    );
    assert!(
        at("src.release_switchover") < at("src.wait_migration"),
        "{calls:?}"
    );
    assert!(
        !calls
            .iter()
            .any(|c| c.contains("remove_device") || c.contains("add_device")),
        "{calls:?}"
    );
    assert_eq!(report.timeline.phases[5].details["fell_back"], 0);
}

#[tokio::test]
async fn a_hot_move_under_a_workflow_pauses_before_the_hand_over() {
    // The workflow migrates the VM itself: no switchover to hold, so the connections
    // pause in the quiesce phase, and nothing is unplugged.
    let bed = Bed::new();
    let mut plan = workflow_plan();
    plan.strategy = Strategy::Hot;
    let report = bed.hand_over_plan(plan).await;
    let quiesce = report.timeline.phase(Phase::Quiesce).expect("a quiesce");
    assert_eq!(quiesce.outcome, PhaseOutcome::Ok, "{report:#?}");
    assert_eq!(quiesce.details["quiesced"], 2, "{report:#?}");
    let calls = bed.calls();
    assert!(calls.iter().any(|c| c == "agent.quiesce"), "{calls:?}");
    assert!(
        !calls.iter().any(|c| c.contains("remove_device")),
        "{calls:?}"
    );
}

/// `hot` to a Cloud Hypervisor destination, with a VF from the destination's pool: it is
/// reserved at prepare and handed to the receiving VMM under the VM's device id; after the
/// migration the attach finds the device there (it moved with the VM) and plugs nothing, and
/// the pool shows the VF attached.
#[tokio::test]
async fn a_hot_move_to_cloud_hypervisor_hands_a_reserved_vf_to_the_receiving_vmm() {
    let dir = tempfile::tempdir().unwrap();
    let sys = dir.path().join("sys");
    let dev = dir.path().join("dev");
    std::fs::create_dir_all(sys.join("bus/pci/devices/0000:3b:02.1/vfio-dev/vfio3")).unwrap();
    std::fs::create_dir_all(dev.join("vfio/devices")).unwrap();
    std::fs::write(dev.join("vfio/devices/vfio3"), "").unwrap();
    std::fs::write(dev.join("iommu"), "").unwrap();
    let config: crate::config::Config =
        toml::from_str("[[pool.function]]\nname = \"vf0\"\npci = \"0000:3b:02.1\"\n").unwrap();
    let mut bed = Bed::new();
    bed.pool = Arc::new(
        Pool::open(&config.pool, &dir.path().join("pool.json"))
            .unwrap()
            .with_host_roots(crate::vfio::Sysfs::new(&sys), &dev),
    );
    let mut asked = Bed::pooled();
    asked.strategy = Strategy::Hot;
    asked.destination = Some(Endpoint::CloudHypervisor {
        api_socket: "/d/api.sock".into(),
        event_monitor: None,
        vsock: Some("/d/vsock.sock".into()),
        agent_port: 7077,
        log_file: None,
        tls_dir: None,
    });
    // `auto` counts the hand-over as the destination's device (the source's VMM says
    // nothing blocks), asking the receiving VMM nothing.
    let auto = MovePlan {
        strategy: Strategy::Auto,
        ..asked.clone()
    };
    let choice = crate::strategy::choose_for(&auto, &FakeBackends(bed.host.clone()), &bed.pool)
        .await
        .unwrap();
    assert_eq!(choice.strategy, Strategy::Hot, "{choice:?}");
    assert!(
        choice.reason.contains("hands the receiving VMM a VF"),
        "{choice:?}"
    );
    let report = bed.run(asked).await;
    assert!(report.ok, "{report:#?}");
    let details = |phase: Phase| {
        report
            .timeline
            .phase(phase)
            .map(|p| p.details.clone())
            .unwrap()
    };
    assert_eq!(details(Phase::Prepare)["function"], "vf0");
    assert_eq!(details(Phase::Prepare)["handed_over"], "vf0");
    assert_eq!(details(Phase::Attach)["already_attached"], true);
    assert_eq!(details(Phase::Attach)["pci"], "0000:3b:02.1");
    assert_eq!(bed.host.state().handed, ["nic0"]);
    assert!(
        !bed.calls().iter().any(|c| c.contains("add_device")),
        "{:?}",
        bed.calls()
    );
    assert!(matches!(
        bed.pool.state("vf0"),
        Some(FunctionState::Attached { vm }) if vm == "vm1"
    ));
}

/// The same to a QEMU destination: nothing is reserved or handed over (its VF is on its
/// command line).
#[tokio::test]
async fn a_hot_move_to_qemu_hands_nothing_over() {
    let bed = Bed::with_pool(1);
    let mut asked = Bed::pooled();
    asked.strategy = Strategy::Hot;
    let report = bed.run(asked).await;
    assert!(report.ok, "{report:#?}");
    assert!(bed.host.state().handed.is_empty());
    assert!(matches!(bed.pool.state("tap0"), Some(FunctionState::Free)));
}
