//! The test bed refuses to start, with an error naming the file, when the guest binaries it
//! requires are not built (no QEMU is started).

use rdmamig_testbed::{Testbed, TestbedError};

#[test]
fn missing_guest_binaries_are_a_clear_error() {
    let empty = tempfile::tempdir().unwrap();
    // This test binary holds only this test, so the variable affects nothing else.
    std::env::set_var("RDMAMIG_BIN_DIR", empty.path());
    match Testbed::new("prereq") {
        Err(TestbedError::GuestBinaryMissing { path }) => {
            assert_eq!(path, empty.path().join("rdmamig-agent"));
        }
        Err(other) => panic!("unexpected error: {other}"),
        Ok(_) => panic!("the test bed started without its guest binaries"),
    }
}
