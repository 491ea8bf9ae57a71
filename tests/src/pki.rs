//! Certificates for tests whose daemons talk over mutual TLS: one CA, and a certificate per
//! host for `localhost` and 127.0.0.1, with the `[peer]` table that names them.

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

    /// Issues the certificate and key `<dir>/<name>.{pem,key}`.
    pub fn issue(&self, name: &str) -> StepResult<()> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()])?;
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
    /// (name, whose certificate, address).
    pub fn peer_table(
        &self,
        name: &str,
        listen: Option<u16>,
        known: &[(&str, &str, u16)],
    ) -> String {
        let dir = self.dir.display();
        let mut text = format!(
            "[peer]\ncert = \"{dir}/{name}.pem\"\nkey = \"{dir}/{name}.key\"\nca = \"{dir}/ca.pem\"\n"
        );
        if let Some(port) = listen {
            text.push_str(&format!("listen = \"127.0.0.1:{port}\"\n"));
        }
        for (peer, cert, port) in known {
            text.push_str(&format!(
                "\n[[peer.known]]\nname = \"{peer}\"\ncert = \"{dir}/{cert}.pem\"\n\
                 address = \"127.0.0.1:{port}\"\n"
            ));
        }
        text
    }
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
