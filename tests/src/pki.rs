//! Certificates for tests whose daemons talk over mutual TLS: one CA, and a certificate per
//! host (for `localhost` and 127.0.0.1, or for a nested host's own address), with the
//! `[peer]` table that names them.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair};

use crate::steps::StepResult;

/// A CA in `dir` and the certificates it issues (for `localhost` and 127.0.0.1).
pub struct Pki {
    dir: PathBuf,
    ca: rcgen::Certificate,
    ca_key: KeyPair,
}

impl Pki {
    /// A new CA, its certificate written to `<dir>/ca.pem`.
    pub fn new(dir: &Path) -> StepResult<Pki> {
        std::fs::create_dir_all(dir)?;
        let ca_key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec!["rdmamig test CA".into()])?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = params.self_signed(&ca_key)?;
        std::fs::write(dir.join("ca.pem"), ca.pem())?;
        Ok(Pki {
            dir: dir.into(),
            ca,
            ca_key,
        })
    }

    /// Issues the certificate and key `<dir>/<name>.{pem,key}` for `localhost` and 127.0.0.1.
    pub fn issue(&self, name: &str) -> StepResult<()> {
        self.issue_for(name, &["localhost", "127.0.0.1"])
    }

    /// Issues the certificate and key `<dir>/<name>.{pem,key}` for the names and addresses
    /// `subjects`.
    pub fn issue_for(&self, name: &str, subjects: &[&str]) -> StepResult<()> {
        let key = KeyPair::generate()?;
        let subjects: Vec<String> = subjects.iter().map(|s| s.to_string()).collect();
        let mut params = CertificateParams::new(subjects)?;
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &self.ca, &self.ca_key)?;
        std::fs::write(self.dir.join(format!("{name}.pem")), cert.pem())?;
        std::fs::write(self.dir.join(format!("{name}.key")), key.serialize_pem())?;
        Ok(())
    }

    /// Where the certificate (`pem`) or key (`key`) of `name` is.
    pub fn file(&self, name: &str, ext: &str) -> PathBuf {
        self.dir.join(format!("{name}.{ext}"))
    }

    /// A `[peer]` table for host `name`, listening on `listen` if given, knowing `known`
    /// (name, whose certificate, address), letting peers name the VMMs under `vmm_paths`.
    pub fn peer_table(
        &self,
        name: &str,
        listen: Option<u16>,
        known: &[(&str, &str, u16)],
        vmm_paths: &[&Path],
    ) -> String {
        let listen = listen.map(|port| format!("127.0.0.1:{port}"));
        let known: Vec<(&str, &str, String)> = known
            .iter()
            .map(|(peer, cert, port)| (*peer, *cert, format!("127.0.0.1:{port}")))
            .collect();
        peer_table_in(&self.dir, name, listen.as_deref(), &known, vmm_paths)
    }

    /// The files of `names` (`<name>.pem`, `<name>.key`) and `ca.pem`, with their contents:
    /// what a nested host needs copied in.
    pub fn files(&self, names: &[&str]) -> StepResult<Vec<(String, Vec<u8>)>> {
        let mut files = vec![(
            "ca.pem".to_string(),
            std::fs::read(self.dir.join("ca.pem"))?,
        )];
        for name in names {
            for ext in ["pem", "key"] {
                let file = format!("{name}.{ext}");
                files.push((file.clone(), std::fs::read(self.dir.join(&file))?));
            }
        }
        Ok(files)
    }
}

/// A `[peer]` table for host `name` whose certificates are in `dir` (on the host that reads
/// it), listening on `listen` if given, knowing `known` (name, whose certificate, address),
/// letting peers name the VMMs under `vmm_paths`.
pub fn peer_table_in(
    dir: &Path,
    name: &str,
    listen: Option<&str>,
    known: &[(&str, &str, String)],
    vmm_paths: &[&Path],
) -> String {
    let dir = dir.display();
    let mut text = format!(
        "[peer]\ncert = \"{dir}/{name}.pem\"\nkey = \"{dir}/{name}.key\"\nca = \"{dir}/ca.pem\"\n"
    );
    if let Some(listen) = listen {
        text.push_str(&format!("listen = \"{listen}\"\n"));
    }
    let vmm_paths: Vec<String> = vmm_paths
        .iter()
        .map(|p| format!("{:?}", p.display().to_string()))
        .collect();
    text.push_str(&format!("vmm_paths = [{}]\n", vmm_paths.join(", ")));
    for (peer, cert, address) in known {
        text.push_str(&format!(
            "\n[[peer.known]]\nname = \"{peer}\"\ncert = \"{dir}/{cert}.pem\"\n\
             address = \"{address}\"\n"
        ));
    }
    text
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
