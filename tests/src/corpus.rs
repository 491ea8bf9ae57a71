//! The fuzz targets' seeds, recorded on the test bed: with `RDMAMIG_RECORD_CORPUS=<dir>`,
//! the scenarios that record a channel ([`crate::tap`], [`crate::capture`]) keep each
//! message as a seed in `<dir>/<target>/` (`fuzz/seeds/` is made so; docs/testbed.md,
//! "Fuzzing").

use std::hash::{Hash, Hasher};
use std::path::Path;

/// Names the folder the seeds go to; without it nothing is kept.
pub const RECORD_CORPUS: &str = "RDMAMIG_RECORD_CORPUS";

/// Keeps each of `messages` as `<dir>/<target>/<prefix>-<hash>` when [`RECORD_CORPUS`]
/// names a folder. The name comes from the content, so a message recorded again is not
/// doubled.
pub fn keep(target: &str, prefix: &str, messages: &[Vec<u8>]) -> std::io::Result<()> {
    let Some(dir) = std::env::var_os(RECORD_CORPUS) else {
        return Ok(());
    };
    let folder = Path::new(&dir).join(target);
    std::fs::create_dir_all(&folder)?;
    for message in messages {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        message.hash(&mut hasher);
        std::fs::write(
            folder.join(format!("{prefix}-{:016x}", hasher.finish())),
            message,
        )?;
    }
    eprintln!(
        "kept {} {target} seeds ({prefix}) in {}",
        messages.len(),
        folder.display()
    );
    Ok(())
}
