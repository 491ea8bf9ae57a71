//! Both ends move: traffic both ways between two VMs, the first VM moves with `rdmamig
//! migrate` (strategy `reconnect`; it is the active side of the connection), then the peer
//! VM moves too (the passive side, with its listener), while traffic keeps running. Nothing
//! may be lost, duplicated or reordered, and neither application may see an error. The
//! second test starts the peer's move half a second after the first VM's, so that the two
//! moves overlap.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use rdmamig_testbed::scenario::{self, Daemon, ScenarioConfig, Strategy};
use rdmamig_testbed::{error_chain, steps, Testbed};

#[test]
fn both_ends_move_one_after_the_other_with_nothing_lost() {
    both_ends_move("both", false);
}

#[test]
fn both_ends_move_at_overlapping_times_with_nothing_lost() {
    both_ends_move("overlap", true);
}

fn both_ends_move(name: &str, overlap: bool) {
    let bed = Testbed::new(name).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let config = ScenarioConfig {
        move_peer: true,
        overlap,
        ..ScenarioConfig::new(Strategy::Reconnect)
    };
    let o = scenario::run(&bed, &daemon, &config).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let peer_output = o.peer_move.as_deref().expect("the peer was moved");
    eprintln!(
        "{}\n{}\n{}",
        o.move_output,
        peer_output,
        scenario::render(&o)
    );
    steps::assert_no_kernel_problems(&o.kernel_problems);
    for (receiver, sender, name) in [(&o.peer, &o.mover, "peer"), (&o.mover, &o.peer, "first VM")] {
        assert_eq!(receiver.lost, 0, "{name} lost messages");
        assert_eq!(receiver.duplicated, 0, "{name} got duplicates");
        assert_eq!(receiver.reordered, 0, "{name} got messages out of order");
        assert_eq!(
            receiver.received, sender.sent,
            "{name} did not receive everything"
        );
        assert!(
            receiver.errors.is_empty(),
            "{name} saw errors: {:?}",
            receiver.errors
        );
        // One after the other: a reconnect after each move. Overlapping: both ends may be
        // away at once, and one reconnect then covers both moves.
        let reconnects = if overlap { 1 } else { 2 };
        assert!(
            receiver.connections_established > reconnects,
            "{name}: the connection should have been re-established {reconnects} time(s): \
             {receiver:?}"
        );
    }
}
