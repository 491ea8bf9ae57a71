//! What a guest kernel logs when something is wrong inside it, picked out of a log (`dmesg`
//! or a console): the move tests fail on it, and a failed test's dump points at it first, so
//! that a guest that crashed under the test bed is told apart from a failure of rdmamig.

/// A WARN or BUG, memory corruption caught by the list checks, an oops, a task hung in the
/// kernel, a panic.
const MARKERS: &[&str] = &[
    "WARNING:",
    "BUG:",
    "corruption",
    "Oops",
    "general protection fault",
    "INFO: task",
    "Kernel panic",
    "stack is corrupted",
];

/// The lines of `log` that report a kernel problem.
pub fn problem_lines(log: &str) -> impl Iterator<Item = &str> {
    log.lines()
        .filter(|line| MARKERS.iter().any(|m| line.contains(m)))
}

#[cfg(test)]
mod tests {
    use super::problem_lines;

    #[test]
    fn kernel_problems_are_picked_out_and_harmless_lines_are_not() {
        let log = "\
[    0.946124] PCI: Using host bridge windows from ACPI; if necessary, use \"pci=nocrs\" and report a bug
[    2.514322] AMD-Vi: AMD IOMMUv2 functionality not available on this system - This is not a bug.
[    9.178819] infiniband rxe_eth0: set down
[   12.000001] WARNING: CPU: 0 PID: 97 at drivers/infiniband/sw/rxe/rxe_pool.c:220 __rxe_cleanup+0x1/0x2
[   13.000002] list_del corruption. prev->next should be ffff8880, but was ffff8881
[   14.000003] BUG: kernel NULL pointer dereference, address: 0000000000000008
[   15.000004] INFO: task rdmamig-traffic:120 blocked for more than 120 seconds.
[   29.251300] Kernel panic - not syncing: stack-protector: Kernel stack is corrupted in: hrtimer_nanosleep+0x163/0x170
";
        let found: Vec<&str> = problem_lines(log).collect();
        assert_eq!(found.len(), 5, "{found:?}");
        assert!(found[0].contains("rxe_pool.c"));
        assert!(found[1].contains("list_del corruption"));
        assert!(found[2].contains("NULL pointer"));
        assert!(found[3].contains("blocked for more than"));
        assert!(found[4].contains("hrtimer_nanosleep"));
    }
}
