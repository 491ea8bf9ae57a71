//! Strategy `vfio-migrate`: the VF's own state moves with the VM through the VFIO migration
//! uAPI v2, and rdmamig only pauses the senders on both ends around the stop-copy.
//!
//! **This has not run on hardware.** No device this project can reach supports VFIO
//! migration (emulated devices answer "not supported", see tests/tests/vfio.rs), so what is
//! here is the device-state machine of the uAPI, the paths a source and a destination walk
//! through it, and the decision of strategy `auto`, all unit-tested against a fake device that
//! enforces the kernel's arcs.
//!
//! The uAPI (linux/vfio.h, `enum vfio_device_mig_state`): a device is in one state; userspace
//! asks for a new one with VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, and the kernel only takes
//! the direct arcs below (a driver may refuse a combined request). P2P states exist only when
//! the device reports VFIO_MIGRATION_P2P, PRE_COPY states only with VFIO_MIGRATION_PRE_COPY;
//! without P2P, RUNNING and STOP are adjacent.
//!
//! Source: RUNNING -> (PRE_COPY, the data read while the VM runs) -> [the migrator has the
//! agents PAUSE every connection: "wait before stop"] -> RUNNING_P2P/PRE_COPY_P2P -> STOP_COPY
//! (the final state is read) -> STOP. Destination: STOP -> RESUMING (the state is written) ->
//! STOP -> RUNNING_P2P -> RUNNING, then the migrator confirms the connections. A failure on
//! the source before STOP_COPY returns the device to RUNNING.

use thiserror::Error;

/// VFIO_MIGRATION_STOP_COPY, VFIO_MIGRATION_P2P, VFIO_MIGRATION_PRE_COPY (linux/vfio.h).
pub const MIGRATION_STOP_COPY: u64 = 1;
/// The device supports the P2P quiescent states.
pub const MIGRATION_P2P: u64 = 2;
/// The device supports pre-copy.
pub const MIGRATION_PRE_COPY: u64 = 4;

/// A device migration state, numbered as the uAPI numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum MigState {
    /// The device failed a transition; only a reset leaves it.
    Error = 0,
    /// Stopped, no DMA, state not being read.
    Stop = 1,
    /// Running normally.
    Running = 2,
    /// Stopped; the final state is being read.
    StopCopy = 3,
    /// Stopped; a state is being written.
    Resuming = 4,
    /// Running, but no longer initiating peer-to-peer DMA.
    RunningP2p = 5,
    /// Running while the state is read ahead.
    PreCopy = 6,
    /// Pre-copy, with peer-to-peer DMA stopped.
    PreCopyP2p = 7,
}

impl MigState {
    /// The state with this uAPI number.
    pub fn from_uapi(value: u32) -> Option<MigState> {
        use MigState::*;
        [
            Error, Stop, Running, StopCopy, Resuming, RunningP2p, PreCopy, PreCopyP2p,
        ]
        .into_iter()
        .find(|s| *s as u32 == value)
    }
}

/// A step the uAPI does not allow, or a device that cannot take part.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum MigError {
    /// The device does not support migration at all (query_migration_support said `None`,
    /// or STOP_COPY is missing).
    #[error("the device does not support VFIO migration (flags {flags:#x})")]
    Unsupported {
        /// What the device reported.
        flags: u64,
    },
    /// No direct arc from one state to the other on this device.
    #[error("no VFIO migration arc from {from:?} to {to:?} on this device (flags {flags:#x})")]
    NoArc {
        /// The state the device is in.
        from: MigState,
        /// The state asked for.
        to: MigState,
        /// The device's migration flags.
        flags: u64,
    },
    /// The device refused a state change.
    #[error("the device refused {from:?} -> {to:?}: {reason}")]
    Refused {
        /// The state the device was in.
        from: MigState,
        /// The state asked for.
        to: MigState,
        /// What it said.
        reason: String,
    },
}

/// Whether `state` exists on a device with `flags`.
fn exists(state: MigState, flags: u64) -> bool {
    match state {
        MigState::RunningP2p => flags & MIGRATION_P2P != 0,
        MigState::PreCopy => flags & MIGRATION_PRE_COPY != 0,
        MigState::PreCopyP2p => {
            flags & (MIGRATION_P2P | MIGRATION_PRE_COPY) == (MIGRATION_P2P | MIGRATION_PRE_COPY)
        }
        _ => true,
    }
}

/// The one transition function: whether the kernel takes `from -> to` directly.
pub fn arc(from: MigState, to: MigState, flags: u64) -> Result<(), MigError> {
    use MigState::*;
    let p2p = flags & MIGRATION_P2P != 0;
    let direct = exists(from, flags)
        && exists(to, flags)
        && match (from, to) {
            (Stop, StopCopy | Resuming) => true,
            (StopCopy | Resuming, Stop) => true,
            (Stop, RunningP2p) | (RunningP2p, Stop) => true,
            (RunningP2p, Running) | (Running, RunningP2p) => true,
            (Running, PreCopy) | (PreCopy, Running) => true,
            (PreCopy, PreCopyP2p) | (PreCopyP2p, PreCopy) => true,
            (RunningP2p, PreCopyP2p) | (PreCopyP2p, RunningP2p) => true,
            (PreCopyP2p, StopCopy) => true,
            // Without P2P states the quiescent step collapses.
            (Running, Stop) | (Stop, Running) => !p2p,
            (PreCopy, StopCopy) => !p2p,
            _ => false,
        };
    if direct {
        Ok(())
    } else {
        Err(MigError::NoArc { from, to, flags })
    }
}

/// What the source's device does, in order; `pause_senders` marks where the migrator has
/// the agents on both ends PAUSE every connection (just before the device stops).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceStep {
    /// Move the device to this state.
    Enter(MigState),
    /// Pause the senders on both ends (the peers stop posting to this VF's QPs).
    PauseSenders,
}

/// The source's walk: RUNNING to STOP through STOP_COPY, pre-copy when the device has it.
pub fn source_path(flags: u64) -> Result<Vec<SourceStep>, MigError> {
    use MigState::*;
    if flags & MIGRATION_STOP_COPY == 0 {
        return Err(MigError::Unsupported { flags });
    }
    let pre = flags & MIGRATION_PRE_COPY != 0;
    let p2p = flags & MIGRATION_P2P != 0;
    let mut steps = Vec::new();
    if pre {
        steps.push(SourceStep::Enter(PreCopy));
    }
    steps.push(SourceStep::PauseSenders);
    match (pre, p2p) {
        (true, true) => steps.push(SourceStep::Enter(PreCopyP2p)),
        (false, true) => {
            steps.push(SourceStep::Enter(RunningP2p));
            steps.push(SourceStep::Enter(Stop));
        }
        (false, false) => steps.push(SourceStep::Enter(Stop)),
        (true, false) => {}
    }
    steps.push(SourceStep::Enter(StopCopy));
    steps.push(SourceStep::Enter(Stop));
    Ok(steps)
}

/// The destination's walk: STOP, RESUMING (state written), STOP, then running.
pub fn destination_path(flags: u64) -> Result<Vec<MigState>, MigError> {
    use MigState::*;
    if flags & MIGRATION_STOP_COPY == 0 {
        return Err(MigError::Unsupported { flags });
    }
    let mut path = vec![Resuming, Stop];
    if flags & MIGRATION_P2P != 0 {
        path.push(RunningP2p);
    }
    path.push(Running);
    Ok(path)
}

/// The way back for a source whose migration failed before STOP_COPY completed: from the
/// state the device is in to RUNNING.
pub fn abort_path(from: MigState, flags: u64) -> Vec<MigState> {
    use MigState::*;
    let p2p = flags & MIGRATION_P2P != 0;
    match from {
        Running | Error => vec![],
        PreCopy => vec![Running],
        PreCopyP2p => vec![PreCopy, Running],
        RunningP2p => vec![Running],
        StopCopy | Resuming if p2p => vec![Stop, RunningP2p, Running],
        Stop if p2p => vec![RunningP2p, Running],
        StopCopy | Resuming => vec![Stop, Running],
        Stop => vec![Running],
    }
}

/// A device whose migration state can be set (vfio-ioctls' `set_migration_state` on a real
/// VF; a fake in the tests).
pub trait MigratableDevice {
    /// The device's migration flags.
    fn flags(&self) -> u64;
    /// The state it is in.
    fn state(&self) -> MigState;
    /// Asks for a direct change.
    fn set_state(&mut self, to: MigState) -> Result<(), MigError>;
}

/// Walks `device` through `states`, checking every arc before asking for it.
pub fn walk(device: &mut dyn MigratableDevice, states: &[MigState]) -> Result<(), MigError> {
    for &to in states {
        arc(device.state(), to, device.flags())?;
        device.set_state(to)?;
    }
    Ok(())
}

/// Strategy `auto`: `vfio-migrate` when the device reports STOP_COPY support (from
/// query_migration_support), the reconnecting move otherwise.
pub fn auto_picks_vfio_migrate(migration_support: Option<u64>) -> bool {
    migration_support.is_some_and(|flags| flags & MIGRATION_STOP_COPY != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use MigState::*;

    const ALL: [MigState; 8] = [
        Error, Stop, Running, StopCopy, Resuming, RunningP2p, PreCopy, PreCopyP2p,
    ];
    const FULL: u64 = MIGRATION_STOP_COPY | MIGRATION_P2P | MIGRATION_PRE_COPY;

    /// A device that enforces the arcs, records its states, and fails on cue.
    struct Fake {
        flags: u64,
        state: MigState,
        seen: Vec<MigState>,
        refuse: Option<MigState>,
    }

    impl MigratableDevice for Fake {
        fn flags(&self) -> u64 {
            self.flags
        }
        fn state(&self) -> MigState {
            self.state
        }
        fn set_state(&mut self, to: MigState) -> Result<(), MigError> {
            arc(self.state, to, self.flags).expect("walk checks arcs first");
            if self.refuse == Some(to) {
                return Err(MigError::Refused {
                    from: self.state,
                    to,
                    reason: "on cue".into(),
                });
            }
            self.state = to;
            self.seen.push(to);
            Ok(())
        }
    }

    fn fake(flags: u64, state: MigState) -> Fake {
        Fake {
            flags,
            state,
            seen: vec![],
            refuse: None,
        }
    }

    #[test]
    fn every_pair_of_states_is_checked() {
        let allowed_full = [
            (Stop, StopCopy),
            (Stop, Resuming),
            (StopCopy, Stop),
            (Resuming, Stop),
            (Stop, RunningP2p),
            (RunningP2p, Stop),
            (RunningP2p, Running),
            (Running, RunningP2p),
            (Running, PreCopy),
            (PreCopy, Running),
            (PreCopy, PreCopyP2p),
            (PreCopyP2p, PreCopy),
            (RunningP2p, PreCopyP2p),
            (PreCopyP2p, RunningP2p),
            (PreCopyP2p, StopCopy),
        ];
        let mut checked = 0;
        for from in ALL {
            for to in ALL {
                checked += 1;
                assert_eq!(
                    arc(from, to, FULL).is_ok(),
                    allowed_full.contains(&(from, to)),
                    "{from:?} -> {to:?}"
                );
            }
        }
        assert_eq!(checked, 64);
        // Without P2P, RUNNING and STOP are adjacent and the P2P states do not exist.
        assert!(arc(Running, Stop, MIGRATION_STOP_COPY).is_ok());
        assert!(arc(Running, Stop, FULL).is_err());
        assert!(arc(Running, RunningP2p, MIGRATION_STOP_COPY).is_err());
        assert!(arc(Running, PreCopy, MIGRATION_STOP_COPY | MIGRATION_P2P).is_err());
        assert_eq!(
            arc(Error, Running, FULL).unwrap_err().to_string(),
            "no VFIO migration arc from Error to Running on this device (flags 0x7)"
        );
    }

    #[test]
    fn source_and_destination_paths_are_walkable_for_every_capability_set() {
        for flags in [
            MIGRATION_STOP_COPY,
            MIGRATION_STOP_COPY | MIGRATION_P2P,
            MIGRATION_STOP_COPY | MIGRATION_PRE_COPY,
            FULL,
        ] {
            let steps = source_path(flags).unwrap();
            let pause = steps
                .iter()
                .position(|s| *s == SourceStep::PauseSenders)
                .unwrap();
            let stop_copy = steps
                .iter()
                .position(|s| *s == SourceStep::Enter(StopCopy))
                .unwrap();
            assert!(pause < stop_copy, "senders pause before the device stops");
            let states: Vec<MigState> = steps
                .iter()
                .filter_map(|s| match s {
                    SourceStep::Enter(state) => Some(*state),
                    SourceStep::PauseSenders => None,
                })
                .collect();
            let mut source = fake(flags, Running);
            walk(&mut source, &states).unwrap();
            assert_eq!(source.state, Stop, "{flags:#x}");
            let mut destination = fake(flags, Stop);
            walk(&mut destination, &destination_path(flags).unwrap()).unwrap();
            assert_eq!(destination.state, Running, "{flags:#x}");
            for from in [Running, PreCopy, PreCopyP2p, RunningP2p, Stop, StopCopy] {
                if !exists(from, flags) {
                    continue;
                }
                let mut aborted = fake(flags, from);
                walk(&mut aborted, &abort_path(from, flags)).unwrap();
                assert_eq!(aborted.state, Running, "{from:?} {flags:#x}");
            }
        }
    }

    #[test]
    fn a_refused_step_stops_the_walk_where_it_is() {
        let mut device = fake(FULL, Running);
        device.refuse = Some(StopCopy);
        let states = [PreCopy, PreCopyP2p, StopCopy, Stop];
        let err = walk(&mut device, &states).unwrap_err();
        assert!(matches!(err, MigError::Refused { to: StopCopy, .. }));
        assert_eq!(device.state, PreCopyP2p);
        walk(&mut device, &abort_path(PreCopyP2p, FULL)).unwrap();
        assert_eq!(device.seen.last(), Some(&Running));
    }

    #[test]
    fn uapi_numbers_match_the_bindings() {
        use vfio_bindings::bindings::vfio as uapi;
        for (state, number) in [
            (Error, uapi::vfio_device_mig_state_VFIO_DEVICE_STATE_ERROR),
            (Stop, uapi::vfio_device_mig_state_VFIO_DEVICE_STATE_STOP),
            (
                Running,
                uapi::vfio_device_mig_state_VFIO_DEVICE_STATE_RUNNING,
            ),
            (
                StopCopy,
                uapi::vfio_device_mig_state_VFIO_DEVICE_STATE_STOP_COPY,
            ),
            (
                Resuming,
                uapi::vfio_device_mig_state_VFIO_DEVICE_STATE_RESUMING,
            ),
            (
                RunningP2p,
                uapi::vfio_device_mig_state_VFIO_DEVICE_STATE_RUNNING_P2P,
            ),
            (
                PreCopy,
                uapi::vfio_device_mig_state_VFIO_DEVICE_STATE_PRE_COPY,
            ),
            (
                PreCopyP2p,
                uapi::vfio_device_mig_state_VFIO_DEVICE_STATE_PRE_COPY_P2P,
            ),
        ] {
            assert_eq!(state as u32, number);
            assert_eq!(MigState::from_uapi(number), Some(state));
        }
        assert_eq!(MigState::from_uapi(8), None);
        assert_eq!(
            MIGRATION_STOP_COPY,
            u64::from(uapi::VFIO_MIGRATION_STOP_COPY)
        );
        assert_eq!(MIGRATION_P2P, u64::from(uapi::VFIO_MIGRATION_P2P));
        assert_eq!(MIGRATION_PRE_COPY, u64::from(uapi::VFIO_MIGRATION_PRE_COPY));
    }

    #[test]
    fn auto_needs_stop_copy() {
        assert!(!auto_picks_vfio_migrate(None));
        assert!(!auto_picks_vfio_migrate(Some(MIGRATION_P2P)));
        assert!(auto_picks_vfio_migrate(Some(MIGRATION_STOP_COPY)));
        assert_eq!(
            source_path(0).unwrap_err(),
            MigError::Unsupported { flags: 0 }
        );
        assert!(destination_path(MIGRATION_P2P).is_err());
    }
}
