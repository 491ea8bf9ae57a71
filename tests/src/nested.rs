//! The two-host nested test bed: RDMA on real SR-IOV VFs, passed through by real VFIO.
//!
//! A *host* is a test-bed guest (L1) that plays a hypervisor host (../shared/TESTBED.md,
//! "Real SR-IOV VFs"): an emulated IOMMU (intel-iommu) and an `igb` NIC, an SR-IOV PF, on a
//! tap of the test bed's bridge, plus the usual permanent virtio-net NIC. Its image (the
//! *host image*) carries QEMU with its firmware, the *VM image*, the `rdmamig` binary, and
//! the igb, VFIO, bridge and tun modules. In the host:
//! - the permanent NIC is enslaved to a bridge `br1` that holds the host's address
//!   (10.78.0.<n>): the hosts' daemons, the migration streams and the VMs' own permanent
//!   NICs (on taps of `br1`) share it;
//! - the rdmamig daemon, with its own config, pool and state, prepares the PF's VFs itself
//!   (`[[pool.sriov]]`) and talks mutual TLS to the other host's daemon;
//! - the VMs (L2) are QEMU processes started from the host's console, each with a VF
//!   through `-device vfio-pci,host=<VF>`. The VM's igbvf driver drives it; the VM image's
//!   NIC hook finds it by its driver (`rdmamig.driver=igbvf`), gives it the VM's MAC and
//!   address and a Soft-RoCE device. VF traffic leaves through the PF onto the test bed's
//!   bridge, so a VM on one host reaches a VM on the other over their VFs.
//!
//! The harness reaches a VM's serial console over TCP: QEMU in the host serves it on the
//! host's address, and the harness connects from inside the namespace, where the bridge has
//! the address [`HARNESS_ADDRESS`]. Everything else (QMP, agent sockets, the daemons) is the
//! host's business and is driven from the host's console, as an operator would.
//!
//! Nested TCG is slow: a host boots in 11-14 s, a VM inside it in 2-10 minutes (docs/testbed.md).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use rdmamig_images::init::{
    AGENT_PORT_NAME, NOT_READY_MARKER, PARAM_DRIVER, PARAM_IP, PARAM_MAC, PARAM_PERMANENT_IP,
    PARAM_PERMANENT_MAC, READY_MARKER,
};
use rdmamig_images::{Image, ImageSpec};
use serde_json::Value;

use crate::console::{CommandOutput, Console};
use crate::guest::{GuestError, Shell};
use crate::pki::{peer_table_in, Pki};
use crate::steps::StepResult;
use crate::testbed::{bin_dir, find_in_path, workspace_root, GUEST_BINARIES};
use crate::{Guest, GuestSpec, NicModel, Testbed};

/// iproute2's ip in the images. By its path: the images' busybox shell runs its own `ip`
/// applet, which has no `tuntap`, before anything in PATH.
const IP: &str = "/usr/sbin/ip";
/// The harness's own address on the test bed's bridge, in the hosts' subnet.
pub const HARNESS_ADDRESS: &str = "10.78.0.254/24";
/// igb's PF, as sysfs spells vendor and device.
const IGB_PF: &str = "0x8086 0x10c9";
/// The driver of igb's VFs inside a VM.
const VF_DRIVER: &str = "igbvf";
/// How long a host may take to boot.
const HOST_BOOT: Duration = Duration::from_secs(240);
/// How long a VM may take to boot inside a host (nested TCG: about 5 minutes measured with
/// one host running, longer with two).
const VM_BOOT: Duration = Duration::from_secs(900);
/// How long a plugged VF may take until its Soft-RoCE device is ACTIVE. Measured with
/// both hosts running (2026-12-02): 342 s and 362 s from igbvf's probe, most of it
/// waiting for the link.
const VF_ACTIVE: Duration = Duration::from_secs(900);
/// How long a VM's console may take to accept the harness (30 s once was not enough at a
/// scenario's start, with both hosts just restored).
const CONSOLE_ATTACH: Duration = Duration::from_secs(120);
/// Host memory: two VMs of [`VM_MEMORY_MIB`] and the images in its tmpfs.
const HOST_MEMORY_MIB: u32 = 1536;
/// VM memory.
const VM_MEMORY_MIB: u32 = 256;
/// Where the host image keeps the VM image.
const VM_KERNEL: &str = "/srv/vm/vmlinux";
const VM_INITRAMFS: &str = "/srv/vm/initramfs.cpio";
/// The daemon's files in a host.
const DAEMON_SOCKET: &str = "/run/rdmamig.sock";
const DAEMON_CONFIG: &str = "/etc/rdmamig/config.toml";
const PKI_DIR: &str = "/etc/rdmamig/pki";
/// Where a nested host's VMs keep their sockets and logs (`<VM_DIR>/<name>/`); what its
/// daemon lets peers name.
const VM_DIR: &str = "/run/vm";
/// The port daemons listen on for each other.
pub const PEER_PORT: u16 = 7300;
/// Console commands in a host: most are quick, some (a move) are not.
const COMMAND: Duration = Duration::from_secs(60);
/// Firmware QEMU loads for a q35 guest with `-kernel` (pvh.bin boots the image's ELF
/// kernel).
const FIRMWARE: &[&str] = &[
    "/usr/share/seabios/bios-256k.bin",
    "/usr/share/qemu/pvh.bin",
    "/usr/share/qemu/kvmvapic.bin",
    "/usr/share/qemu/linuxboot.bin",
    "/usr/share/qemu/linuxboot_dma.bin",
];
/// Where Debian's QEMU keeps its loadable modules (the TCG accelerator is one in some
/// builds).
const QEMU_MODULE_DIR: &str = "/usr/lib/x86_64-linux-gnu/qemu";

/// The VM image (the test bed's, with igbvf) and the host image that carries it.
pub struct Images {
    /// What the VMs boot.
    pub vm: Image,
    /// What the hosts boot.
    pub host: Image,
}

/// Builds both images into `<workspace>/target/testbed-nested` (reused when unchanged).
pub fn build_images() -> StepResult<Images> {
    let out = workspace_root().join("target/testbed-nested");
    let vm = rdmamig_images::build(&ImageSpec {
        out_dir: out.join("vm"),
        guest_binaries: GUEST_BINARIES.iter().map(|b| bin_dir().join(b)).collect(),
        extra_modules: vec![VF_DRIVER.into()],
        strip_debug: true,
        uncompressed: true,
        ..ImageSpec::default()
    })?;
    let qemu = find_in_path("qemu-system-x86_64").ok_or("qemu-system-x86_64 is not in PATH")?;
    let mut host_programs = vec![qemu];
    if let Ok(entries) = std::fs::read_dir(QEMU_MODULE_DIR) {
        host_programs.extend(
            entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("accel-"))
                }),
        );
    }
    let mut files: Vec<(PathBuf, PathBuf)> = FIRMWARE
        .iter()
        .map(|f| (PathBuf::from(f), PathBuf::from(f)))
        .collect();
    files.push((vm.kernel.clone(), VM_KERNEL.into()));
    files.push((vm.initramfs.clone(), VM_INITRAMFS.into()));
    let host = rdmamig_images::build(&ImageSpec {
        out_dir: out.join("host"),
        guest_binaries: vec![bin_dir().join("rdmamig")],
        extra_modules: [
            "igb",
            "vfio",
            "vfio_iommu_type1",
            "vfio-pci",
            "bridge",
            "tun",
        ]
        .map(String::from)
        .to_vec(),
        host_programs,
        files,
        strip_debug: true,
        ..ImageSpec::default()
    })?;
    Ok(Images { vm, host })
}

/// A host saved by [`Host::save`]: its snapshot file and what [`Host::restore`] needs to
/// start it again, VMs and daemon running as they were.
pub struct SavedHost {
    spec: GuestSpec,
    address: String,
    pf: String,
    file: PathBuf,
}

/// One host: an L1 guest with an IOMMU and an igb PF, its bridge, and its daemon.
pub struct Host {
    guest: Guest,
    /// Its address in the hosts' subnet (`10.78.0.11`).
    address: String,
    /// Its PF's PCI address.
    pf: String,
    netns: String,
}

impl Host {
    /// Boots host `name` on `bed` from the host image and sets up its bridge.
    pub fn boot(bed: &Testbed, images: &Images, name: &str) -> StepResult<Host> {
        let spec = GuestSpec {
            rdma_nic: NicModel::Igb,
            iommu: true,
            cpus: 2,
            memory_mib: HOST_MEMORY_MIB,
            ..bed.guest_spec(name)?
        };
        let address = spec.permanent_address().to_owned();
        let guest = bed.start_guest_from(spec, &images.host, HOST_BOOT)?;
        let spec = guest.spec().clone();
        // The permanent NIC becomes a port of br1, which takes over its address.
        guest.run_ok(
            &format!(
                "nic=$(for f in /sys/class/net/*/address; do \
                   [ \"$(cat $f)\" = {mac} ] && d=${{f%/address}} && echo ${{d##*/}}; done; true) && \
                 [ -n \"$nic\" ] && {IP} addr flush dev $nic && {IP} link add br1 type bridge && \
                 {IP} link set br1 up && {IP} link set $nic master br1 && {IP} addr add {ip} dev br1",
                mac = spec.permanent_mac,
                ip = spec.permanent_ip
            ),
            COMMAND,
        )?;
        let pf = guest.run_ok(
            &format!(
                "for d in /sys/bus/pci/devices/*; do \
                   [ \"$(cat $d/vendor) $(cat $d/device)\" = \"{IGB_PF}\" ] && echo ${{d##*/}}; \
                 done; true"
            ),
            COMMAND,
        )?;
        let pf = pf.trim().to_owned();
        if pf.is_empty() || pf.contains('\n') {
            return Err(format!("host {name}: not exactly one igb PF: {pf:?}").into());
        }
        Ok(Host {
            guest,
            address,
            pf,
            netns: bed.netns().to_owned(),
        })
    }

    /// Saves the host, with its daemon and VMs, to `file` (a snapshot of the whole L1 guest,
    /// made by the test bed's QEMU) and stops it. Drop the [`Vm`] handles first: their
    /// console connections would stay taken in the saved host.
    ///
    /// A VF in use does not survive this: QEMU 10's igbvf has no migration state, so a
    /// restored VF's command register and MSI-X table are back at their reset values (no
    /// DMA, no interrupts) while the drivers above believe otherwise; the PF is fine. Save
    /// hosts whose VMs have no VF yet, and plug the VFs after the restore
    /// ([`Host::plug_vf`]).
    pub fn save(self, file: &Path) -> StepResult<SavedHost> {
        // Let the VMs' QEMUs see their console clients go before the host is frozen.
        self.guest.run_ok("sleep 2", COMMAND)?;
        self.guest.save(file)?;
        Ok(SavedHost {
            spec: self.guest.spec().clone(),
            address: self.address,
            pf: self.pf,
            file: file.to_owned(),
        })
    }

    /// Starts a host saved by [`Host::save`] again, on the same taps: its daemon and VMs
    /// carry on where they were. Only one copy of a saved host may run at a time.
    pub fn restore(bed: &Testbed, images: &Images, saved: &SavedHost) -> StepResult<Host> {
        let guest = bed.restore_guest(saved.spec.clone(), &images.host, &saved.file)?;
        Ok(Host {
            guest,
            address: saved.address.clone(),
            pf: saved.pf.clone(),
            netns: bed.netns().to_owned(),
        })
    }

    /// The assertion this host's QEMU (the test bed's, running the L1 guest) died of, if it
    /// did.
    pub fn emulator_assertion(&self) -> Option<String> {
        self.guest.emulator_assertion()
    }

    /// A handle on VM `spec`, already running in this host (a restored host's).
    pub fn vm(&self, spec: VmSpec) -> StepResult<Vm> {
        Ok(Vm {
            console_at: SocketAddr::new(self.address.parse()?, spec.console_port()),
            netns: self.netns.clone(),
            console: Mutex::new(None),
            dir: format!("{VM_DIR}/{}", spec.name),
            spec,
        })
    }

    /// The host's name.
    pub fn name(&self) -> &str {
        self.guest.name()
    }

    /// The host's address (`10.78.0.11`).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Its PF's PCI address.
    pub fn pf(&self) -> &str {
        &self.pf
    }

    /// The host's console (for commands an operator would type there).
    pub fn shell(&self) -> &Guest {
        &self.guest
    }

    /// Writes `contents` to `path` in the host (through its console, base64-encoded).
    pub fn write_file(&self, path: &str, contents: &[u8]) -> StepResult<()> {
        let dir = Path::new(path).parent().map(|d| d.display().to_string());
        self.guest.run_ok(
            &format!(
                "mkdir -p {} && echo {} | base64 -d > {path}",
                dir.unwrap_or_else(|| "/".into()),
                base64(contents)
            ),
            COMMAND,
        )?;
        Ok(())
    }

    /// Starts the host's daemon with the PKI's files for `name`, a pool of `vfs` VFs of its
    /// PF and a `[peer]` table listening on [`PEER_PORT`] and knowing `known` (name,
    /// address); returns once its socket is there, with the daemon's log.
    pub fn start_daemon(&self, pki: &Pki, vfs: u32, known: &[(&str, &str)]) -> StepResult<String> {
        let name = self.name();
        // Its own certificate and key, the CA, and the certificates of the hosts it knows.
        let mut files = pki.files(&[name])?;
        for (peer, _) in known {
            files.extend(
                pki.files(&[peer])?
                    .into_iter()
                    .filter(|(file, _)| file == &format!("{peer}.pem")),
            );
        }
        for (file, contents) in files {
            self.write_file(&format!("{PKI_DIR}/{file}"), &contents)?;
        }
        let known: Vec<(&str, &str, String)> = known
            .iter()
            .map(|(peer, address)| (*peer, *peer, format!("{address}:{PEER_PORT}")))
            .collect();
        let config = format!(
            "[[pool.sriov]]\npf = \"{pf}\"\nvfs = {vfs}\n\n{peer}",
            pf = self.pf,
            peer = peer_table_in(
                Path::new(PKI_DIR),
                name,
                Some(&format!("{}:{PEER_PORT}", self.address)),
                &known,
                &[Path::new(VM_DIR)],
            )
        );
        self.write_file(DAEMON_CONFIG, config.as_bytes())?;
        let log = self.guest.run_ok(
            &format!(
                "mkdir -p /var/lib/rdmamig; \
                 RUST_LOG=info rdmamig daemon --socket {DAEMON_SOCKET} --state-dir /var/lib/rdmamig \
                   --config {DAEMON_CONFIG} </dev/null >/run/daemon.log 2>&1 & echo $! >/run/daemon.pid; \
                 i=0; while [ ! -S {DAEMON_SOCKET} ]; do \
                   kill -0 $(cat /run/daemon.pid) 2>/dev/null || {{ cat /run/daemon.log; exit 1; }}; \
                   i=$((i+1)); [ $i -gt 300 ] && {{ cat /run/daemon.log; exit 1; }}; sleep 0.1; done; \
                 cat /run/daemon.log"
            ),
            COMMAND,
        )?;
        Ok(log)
    }

    /// `rdmamig <args> --socket <the daemon's>` in the host; returns status and output.
    pub fn rdmamig(&self, args: &str, timeout: Duration) -> StepResult<CommandOutput> {
        Ok(self
            .guest
            .run(&format!("rdmamig {args} --socket {DAEMON_SOCKET}"), timeout)?)
    }

    /// Starts `rdmamig <args> --socket <the daemon's>` in the host without waiting: its
    /// output goes to `<output>`, and its exit status, once it ends, to `<output>.status`.
    pub fn spawn_rdmamig(&self, args: &str, output: &str) -> StepResult<()> {
        self.guest.run_ok(
            &format!(
                "rm -f {output}.status; \
                 (rdmamig {args} --socket {DAEMON_SOCKET} >{output} 2>&1; echo $? >{output}.status) \
                 </dev/null >/dev/null 2>&1 &"
            ),
            COMMAND,
        )?;
        Ok(())
    }

    /// The daemon's pool (`rdmamig pool --json`): every function with its state.
    pub fn pool(&self) -> StepResult<Vec<Value>> {
        let out = self.rdmamig("pool --json", COMMAND)?;
        if out.status != 0 {
            return Err(format!("{}: rdmamig pool: {}", self.name(), out.output).into());
        }
        let start = out.output.find('[').ok_or("no JSON from rdmamig pool")?;
        Ok(serde_json::from_str(&out.output[start..])?)
    }

    /// The PCI address of pool function `name`.
    pub fn function_pci(&self, name: &str) -> StepResult<String> {
        self.pool()?
            .iter()
            .find(|f| f["name"] == name)
            .and_then(|f| f["attachment"]["pci"].as_str().map(str::to_owned))
            .ok_or_else(|| format!("{}: no VF {name} in the pool", self.name()).into())
    }

    /// Starts VM `spec` in this host and, unless it is a migration destination, waits until
    /// it has booted; with `spec.vf` passed through, also until the VF has an ACTIVE
    /// Soft-RoCE device.
    pub fn start_vm(&self, spec: VmSpec) -> StepResult<Vm> {
        let dir = format!("{VM_DIR}/{}", spec.name);
        let tap = format!("t{}", spec.number);
        let args = vm_args(&spec, &self.address, &dir, &tap).join(" ");
        self.guest.run_ok(
            &format!(
                "mkdir -p {dir} && {IP} tuntap add {tap} mode tap && {IP} link set {tap} master br1 up && \
                 {{ qemu-system-x86_64 {args} </dev/null >{dir}/qemu.log 2>&1 & echo $! >{dir}/pid; }}; \
                 i=0; while [ ! -S {dir}/qmp.sock ]; do \
                   kill -0 $(cat {dir}/pid) 2>/dev/null || {{ cat {dir}/qemu.log; exit 1; }}; \
                   i=$((i+1)); [ $i -gt 300 ] && {{ cat {dir}/qemu.log; exit 1; }}; sleep 0.1; done"
            ),
            COMMAND,
        )?;
        if !spec.incoming {
            // The console log in the host keeps what the VM printed before the harness
            // connected (a TCP console drops output while no client is connected).
            let log = format!("{dir}/console.log");
            let waited = self.guest.run(
                &format!(
                    "i=0; until grep -q -e {READY_MARKER} -e {NOT_READY_MARKER} {log} 2>/dev/null; do \
                       kill -0 $(cat {dir}/pid) 2>/dev/null || {{ cat {dir}/qemu.log; exit 1; }}; \
                       i=$((i+1)); [ $i -gt {polls} ] && exit 1; sleep 1; done",
                    polls = VM_BOOT.as_secs()
                ),
                VM_BOOT + COMMAND,
            )?;
            if waited.status != 0 {
                return Err(format!(
                    "VM {} did not boot within {VM_BOOT:?}: {}",
                    spec.name, waited.output
                )
                .into());
            }
        }
        let vm = self.vm(spec)?;
        if !vm.spec.incoming && vm.spec.vf.is_some() {
            // The VF's carrier may come later than the image's own wait for it (TESTBED.md:
            // ~29 s of VM time); the NIC hook keeps trying.
            wait_vf_active(&vm)?;
        }
        Ok(vm)
    }

    /// Gives VF `vf` (a PCI address) the MAC `mac` through its PF, as an operator does
    /// before passing a VF through (`ip link set <PF> vf <n> mac`): the VM's driver then
    /// finds the VM's MAC on the VF, as after a move (`mac=` of `--attach`).
    pub fn set_vf_mac(&self, vf: &str, mac: &str) -> StepResult<()> {
        self.guest.run_ok(
            &format!(
                "pf=/sys/bus/pci/devices/{pf}; dev=$(ls $pf/net); n=; \
                 for l in $pf/virtfn*; do \
                   [ \"$(basename $(readlink $l))\" = {vf} ] && n=${{l##*virtfn}}; done; \
                 [ -n \"$n\" ] || {{ echo 'no VF {vf} on PF {pf}'; exit 1; }}; \
                 {IP} link set dev $dev vf $n mac {mac}",
                pf = self.pf
            ),
            COMMAND,
        )?;
        Ok(())
    }

    /// Plugs VF `vf` into running VM `vm` as `nic0` on `rp1` (QMP `device_add`, as a VMM
    /// does), and waits until the VM's own igbvf drives it with an ACTIVE Soft-RoCE device.
    pub fn plug_vf(&self, vm: &Vm, vf: &str) -> StepResult<()> {
        let add = format!(
            r#"{{"execute":"device_add","arguments":{{"driver":"vfio-pci","host":"{vf}","id":"nic0","bus":"rp1"}}}}"#
        );
        // The host's busybox has no UNIX-socket client: the VM's second QMP monitor
        // listens on the host's loopback. device_add answers once the device is realized
        // (its DMA mapped through the host's IOMMU), which takes seconds nested.
        let out = self.guest.run_ok(
            &format!(
                "out={dir}/plug.qmp; : >$out; \
                 {{ echo '{{\"execute\":\"qmp_capabilities\"}}'; echo '{add}'; sleep {wait}; }} | \
                   nc 127.0.0.1 {port} >$out & p=$!; i=0; \
                 until [ $(grep -c -e '\"return\"' -e '\"error\"' $out) -ge 2 ]; do \
                   i=$((i+1)); [ $i -gt {polls} ] && break; sleep 0.5; done; kill $p 2>/dev/null; cat $out",
                dir = vm.dir,
                port = vm.spec.qmp_port(),
                wait = COMMAND.as_secs(),
                polls = COMMAND.as_secs() * 2,
            ),
            COMMAND + COMMAND,
        )?;
        if out.contains("\"error\"") || out.matches("\"return\"").count() < 2 {
            return Err(format!(
                "{}: device_add {vf} into {}: {out}",
                self.name(),
                vm.spec.name
            )
            .into());
        }
        wait_vf_active(vm)?;
        Ok(())
    }

    /// What the host shows of its VMs and daemon, for a failure report.
    pub fn dump(&self) -> String {
        let out = self.guest.run(
            "tail -n 40 /run/daemon.log /run/vm/*/qemu.log; tail -n 80 /run/vm/*/console.log; \
             dmesg | tail -n 40",
            COMMAND,
        );
        match out {
            Ok(out) => format!("===== host {} =====\n{}", self.name(), out.output),
            Err(e) => format!("===== host {}: {}", self.name(), crate::error_chain(&e)),
        }
    }
}

/// Waits until `vm`'s VF has an ACTIVE Soft-RoCE device (see [`VF_ACTIVE`]).
pub fn wait_vf_active(vm: &Vm) -> StepResult<()> {
    // Every 5 s: each look starts processes, which take seconds in a nested VM, and a busy
    // VM delays its VF driver's exchanges with the PF.
    let wait = format!("rdmamig-netplug wait-active {} 5", VF_ACTIVE.as_secs());
    vm.run_ok(&wait, VF_ACTIVE + COMMAND)?;
    Ok(())
}

/// What a VM in a host is.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// Its name (`mv`, `peer`, `mv-dst`).
    pub name: String,
    /// Its number: addresses 10.77.0.<n> (VF) and 10.78.0.<n> (permanent NIC), MACs to
    /// match; a destination has its source's.
    pub number: u8,
    /// The VF passed through at start, by PCI address; `None` for a VM whose VF is plugged
    /// later ([`Host::plug_vf`]) and for a destination, whose VF is plugged by the move.
    pub vf: Option<String>,
    /// A migration destination (`-incoming defer`).
    pub incoming: bool,
    /// Which of a number's consoles (a destination needs its own).
    pub console_slot: u8,
}

impl VmSpec {
    /// A VM with no VF yet.
    pub fn new(name: &str, number: u8) -> VmSpec {
        VmSpec {
            name: name.into(),
            number,
            vf: None,
            incoming: false,
            console_slot: 0,
        }
    }

    /// The same VM with VF `vf` passed through at start.
    pub fn with_vf(self, vf: &str) -> VmSpec {
        VmSpec {
            vf: Some(vf.into()),
            ..self
        }
    }

    /// The destination of a move of `self`: same addresses and MACs, no VF, `-incoming
    /// defer`.
    pub fn destination(&self, name: &str) -> VmSpec {
        VmSpec {
            name: name.into(),
            vf: None,
            incoming: true,
            console_slot: self.console_slot + 1,
            ..self.clone()
        }
    }

    /// The VF's address with its prefix.
    pub fn ip(&self) -> String {
        format!("10.77.0.{}/24", self.number)
    }

    /// The VF's address.
    pub fn address(&self) -> String {
        format!("10.77.0.{}", self.number)
    }

    /// Its permanent NIC's address (the `bridge` strategy's path).
    pub fn permanent_address(&self) -> String {
        format!("10.78.0.{}", self.number)
    }

    /// The MAC the VM gives its VF.
    pub fn mac(&self) -> String {
        format!("52:54:00:77:00:{:02x}", self.number)
    }

    fn console_port(&self) -> u16 {
        5000 + u16::from(self.number) * 4 + u16::from(self.console_slot)
    }

    /// Its second QMP monitor, on the host's loopback (for the host's shell).
    fn qmp_port(&self) -> u16 {
        6000 + u16::from(self.number) * 4 + u16::from(self.console_slot)
    }

    /// Its QMP socket in the host.
    pub fn qmp(&self) -> String {
        format!("{VM_DIR}/{}/qmp.sock", self.name)
    }

    /// Its agent socket in the host.
    pub fn agent(&self) -> String {
        format!("{VM_DIR}/{}/agent.sock", self.name)
    }
}

/// QEMU's arguments for VM `spec` in a host: the test bed's guest (q35, root ports rp1-rp3,
/// permanent NIC on rp3, the agent's virtio-serial port), with a VF on rp1 instead of an
/// emulated NIC, and its console on TCP.
fn vm_args(spec: &VmSpec, host: &str, dir: &str, tap: &str) -> Vec<String> {
    let n = spec.number;
    let mut args = vec![
        format!("-name {}", spec.name),
        "-accel tcg -machine q35 -smp 1 -nographic -nodefaults -no-reboot".into(),
        format!("-m {VM_MEMORY_MIB}"),
        format!("-kernel {VM_KERNEL} -initrd {VM_INITRAMFS}"),
        // tsc=reliable: a nested VM's vCPU starves for seconds at a time, the clocksource
        // watchdog then took the TSC for unstable and the kernel fell back to the HPET
        // (seen in the VMs of failed gold runs), whose every read QEMU emulates.
        format!(
            "-append 'console=ttyS0 panic=-1 quiet cryptomgr.notests tsc=reliable {PARAM_IP}={} {PARAM_MAC}={} \
             {PARAM_DRIVER}={VF_DRIVER} {PARAM_PERMANENT_IP}=10.78.0.{n}/24 \
             {PARAM_PERMANENT_MAC}=52:54:00:78:00:{n:02x}'",
            spec.ip(),
            spec.mac()
        ),
        format!(
            "-chardev socket,id=ser0,host={host},port={},server=on,wait=off,logfile={dir}/console.log",
            spec.console_port()
        ),
        "-serial chardev:ser0".into(),
        format!("-qmp unix:{dir}/qmp.sock,server=on,wait=off"),
        format!(
            "-qmp tcp:127.0.0.1:{},server=on,wait=off",
            spec.qmp_port()
        ),
        "-device pcie-root-port,id=rp1,slot=1,chassis=1".into(),
        "-device pcie-root-port,id=rp2,slot=2,chassis=2".into(),
        "-device pcie-root-port,id=rp3,slot=3,chassis=3".into(),
        format!("-netdev tap,id=nd1,ifname={tap},script=no,downscript=no"),
        format!("-device virtio-net-pci,netdev=nd1,mac=52:54:00:78:00:{n:02x},id=pnic0,bus=rp3,romfile="),
        "-device virtio-serial-pci,id=vser0".into(),
        format!("-chardev socket,path={dir}/agent.sock,server=on,wait=off,id=ch0"),
        format!("-device virtserialport,chardev=ch0,name={AGENT_PORT_NAME},bus=vser0.0"),
    ];
    if let Some(vf) = &spec.vf {
        args.push(format!("-device vfio-pci,host={vf},id=nic0,bus=rp1"));
    }
    if spec.incoming {
        args.push("-incoming defer".into());
    }
    args
}

/// A VM inside a host, reached through its console over TCP.
pub struct Vm {
    spec: VmSpec,
    dir: String,
    console_at: SocketAddr,
    netns: String,
    console: Mutex<Option<Console>>,
}

impl Vm {
    /// What it is.
    pub fn spec(&self) -> &VmSpec {
        &self.spec
    }

    /// Its directory in the host (QMP, agent socket, logs).
    pub fn dir(&self) -> &str {
        &self.dir
    }

    /// (Re)connects to the console: after a move, the destination's console carries on the
    /// source's shell loop.
    pub fn attach_console(&self) -> Result<(), GuestError> {
        let mut slot = self.console.lock().unwrap_or_else(|p| p.into_inner());
        slot.take();
        // A host just restored, or busy with both its VMs, may take a while to accept.
        let console = Console::connect_tcp(&self.netns, self.console_at, CONSOLE_ATTACH).map_err(
            |source| GuestError::Attach {
                guest: self.spec.name.clone(),
                source,
            },
        )?;
        *slot = Some(console);
        Ok(())
    }
}

impl Shell for Vm {
    fn name(&self) -> &str {
        &self.spec.name
    }

    /// Nested TCG: a process start alone takes about a second.
    fn pace(&self) -> u32 {
        10
    }

    fn run(&self, command: &str, timeout: Duration) -> Result<CommandOutput, GuestError> {
        if self
            .console
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
        {
            self.attach_console()?;
        }
        let console = self.console.lock().unwrap_or_else(|p| p.into_inner());
        let Some(console) = console.as_ref() else {
            unreachable!("attached above")
        };
        console
            .run(command, timeout)
            .map_err(|source| GuestError::Command {
                guest: self.spec.name.clone(),
                command: command.to_owned(),
                source,
            })
    }
}

/// Standard base64 (RFC 4648, with padding), for files sent through a console.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> shift & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_rfc_examples() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), encoded);
        }
    }

    #[test]
    fn a_destination_keeps_its_sources_addresses_but_not_its_console() {
        let source = VmSpec::new("mv", 101).with_vf("0000:01:10.0");
        let destination = source.destination("mv-dst");
        assert_eq!(destination.address(), source.address());
        assert_eq!(destination.mac(), source.mac());
        assert_ne!(destination.console_port(), source.console_port());
        assert!(destination.vf.is_none() && destination.incoming);
        let args = vm_args(&destination, "10.78.0.12", "/run/vm/mv-dst", "t101").join(" ");
        assert!(args.contains("-incoming defer") && !args.contains("vfio-pci"));
        let args = vm_args(&source, "10.78.0.11", "/run/vm/mv", "t101").join(" ");
        assert!(args.contains("-device vfio-pci,host=0000:01:10.0,id=nic0,bus=rp1"));
        assert!(args.contains("rdmamig.driver=igbvf"));
    }
}
