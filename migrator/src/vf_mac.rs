//! A VF's MAC address, set through its PF before the VF is plugged, as
//! `ip link set <PF> vf <N> mac <MAC>` does (rtnetlink `RTM_SETLINK` with
//! `IFLA_VFINFO_LIST`).
//!
//! Why: a VM's network config knows the VM's MAC, not the VF's, and a move plugs a
//! different VF with a MAC of its own. A VF's driver may ask the PF for another MAC, but
//! PF drivers restrict that (igb refused such a request on the test bed: "VF n attempted
//! to set invalid MAC filter"). A MAC the PF sets is the VF's own from its next reset on, so the guest's driver finds the VM's MAC already there, as libvirt does
//! for `<interface type='hostdev'>`. The move's `--attach` names it with `mac=`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

use crate::vfio::Sysfs;

/// How long the kernel may take to answer.
const ANSWER: Duration = Duration::from_secs(5);

/// rtnetlink's numbers (linux/rtnetlink.h, linux/if_link.h, linux/netlink.h).
const RTM_SETLINK: u16 = 19;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLMSG_ERROR: u16 = 2;
const IFLA_VFINFO_LIST: u16 = 22;
const IFLA_VF_INFO: u16 = 1;
const IFLA_VF_MAC: u16 = 1;
/// `struct ifla_vf_mac`'s address field.
const VF_MAC_LEN: usize = 32;

/// Why a VF's MAC could not be set.
#[derive(Debug, Error)]
pub enum VfMacError {
    /// Not a MAC a VF can have (six hex bytes, unicast, not all zero).
    #[error("{mac:?} is not a unicast MAC address (aa:bb:cc:dd:ee:ff)")]
    BadMac {
        /// As given.
        mac: String,
    },
    /// Sysfs does not show the VF's PF, its index, or the PF's netdev.
    #[error("{vf}: cannot find {what} in {path}")]
    Topology {
        /// The VF.
        vf: String,
        /// What was looked for.
        what: &'static str,
        /// Where.
        path: PathBuf,
    },
    /// The netlink socket failed.
    #[error("rtnetlink: cannot {step}")]
    Netlink {
        /// What was being done.
        step: &'static str,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// The PF's driver refused.
    #[error("{pf} ({netdev}) refused MAC {mac} for VF {index}")]
    Refused {
        /// The PF.
        pf: String,
        /// Its netdev.
        netdev: String,
        /// The VF's index on it.
        index: u32,
        /// The MAC.
        mac: String,
        /// The kernel's answer.
        #[source]
        source: io::Error,
    },
}

/// Gives VF `vf` (a PCI address) the MAC `mac` through its PF.
pub fn set(sysfs: &Sysfs, vf: &str, mac: &str) -> Result<(), VfMacError> {
    let address = parse_mac(mac)?;
    let target = VfTarget::find(sysfs, vf)?;
    let request = set_vf_mac_request(target.ifindex, target.index, &address, 1);
    talk(&request).map_err(|e| match e {
        Answer::Socket(step, source) => VfMacError::Netlink { step, source },
        Answer::Refused(source) => VfMacError::Refused {
            pf: target.pf.clone(),
            netdev: target.netdev.clone(),
            index: target.index,
            mac: mac.into(),
            source,
        },
    })
}

/// A MAC address as bytes: six hex pairs split by colons, unicast and not all zero.
fn parse_mac(mac: &str) -> Result<[u8; 6], VfMacError> {
    let bad = || VfMacError::BadMac { mac: mac.into() };
    let mut bytes = [0u8; 6];
    let mut parts = mac.split(':');
    for byte in &mut bytes {
        let part = parts.next().ok_or_else(bad)?;
        if part.len() != 2 {
            return Err(bad());
        }
        *byte = u8::from_str_radix(part, 16).map_err(|_| bad())?;
    }
    if parts.next().is_some() || bytes[0] & 1 == 1 || bytes == [0; 6] {
        return Err(bad());
    }
    Ok(bytes)
}

/// Where a VF's MAC is set: its PF, the PF's netdev and interface index, the VF's index.
#[derive(Debug, PartialEq, Eq)]
struct VfTarget {
    pf: String,
    netdev: String,
    ifindex: u32,
    index: u32,
}

impl VfTarget {
    fn find(sysfs: &Sysfs, vf: &str) -> Result<VfTarget, VfMacError> {
        let missing = |what, path: PathBuf| VfMacError::Topology {
            vf: vf.into(),
            what,
            path,
        };
        let physfn = sysfs.device(vf).join("physfn");
        let pf = std::fs::read_link(&physfn)
            .ok()
            .and_then(|t| t.file_name()?.to_str().map(str::to_owned))
            .ok_or_else(|| missing("its PF (physfn)", physfn))?;
        let pf_dir = sysfs.device(&pf);
        // The PF's VFs come in virtfn order, and virtfn<N> is VF N.
        let index = sysfs
            .vfs(&pf)
            .ok()
            .and_then(|vfs| vfs.iter().position(|address| address == vf))
            .and_then(|index| u32::try_from(index).ok())
            .ok_or_else(|| missing("its virtfn link", pf_dir.clone()))?;
        let net = pf_dir.join("net");
        let netdev = std::fs::read_dir(&net)
            .ok()
            .and_then(|mut entries| entries.find_map(|e| e.ok()?.file_name().into_string().ok()))
            .ok_or_else(|| missing("the PF's netdev", net.clone()))?;
        let ifindex_file = net.join(&netdev).join("ifindex");
        let ifindex = std::fs::read_to_string(&ifindex_file)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| missing("the PF's interface index", ifindex_file))?;
        Ok(VfTarget {
            pf,
            netdev,
            ifindex,
            index,
        })
    }
}

/// One rtnetlink attribute: header, payload, padding to 4 bytes.
fn attribute(kind: u16, payload: &[u8]) -> Vec<u8> {
    let len = 4 + payload.len();
    let mut out = Vec::with_capacity(len.next_multiple_of(4));
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    out.resize(len.next_multiple_of(4), 0);
    out
}

/// `RTM_SETLINK` on interface `ifindex` giving its VF `index` the MAC `mac`, asking for an
/// acknowledgement.
fn set_vf_mac_request(ifindex: u32, index: u32, mac: &[u8; 6], seq: u32) -> Vec<u8> {
    // struct ifla_vf_mac { __u32 vf; __u8 mac[32]; }
    let mut vf_mac = index.to_ne_bytes().to_vec();
    vf_mac.extend_from_slice(mac);
    vf_mac.resize(4 + VF_MAC_LEN, 0);
    let list = attribute(
        IFLA_VFINFO_LIST,
        &attribute(IFLA_VF_INFO, &attribute(IFLA_VF_MAC, &vf_mac)),
    );
    // struct ifinfomsg { family, pad, type, index, flags, change }: 16 bytes.
    let mut ifinfo = vec![0u8; 16];
    ifinfo[4..8].copy_from_slice(&ifindex.to_ne_bytes());
    let len = 16 + ifinfo.len() + list.len();
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&(len as u32).to_ne_bytes());
    out.extend_from_slice(&RTM_SETLINK.to_ne_bytes());
    out.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(&ifinfo);
    out.extend_from_slice(&list);
    out
}

/// What went wrong talking to the kernel.
enum Answer {
    Socket(&'static str, io::Error),
    Refused(io::Error),
}

/// The kernel's acknowledgement in `reply`: `Ok` for error 0, the errno otherwise; `None`
/// when `reply` is not an `NLMSG_ERROR` message.
fn acknowledgement(reply: &[u8]) -> Option<Result<(), io::Error>> {
    let kind = u16::from_ne_bytes(reply.get(4..6)?.try_into().ok()?);
    if kind != NLMSG_ERROR {
        return None;
    }
    let error = i32::from_ne_bytes(reply.get(16..20)?.try_into().ok()?);
    Some(if error == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(-error))
    })
}

/// Sends `request` on a new NETLINK_ROUTE socket and waits, bounded, for its acknowledgement.
fn talk(request: &[u8]) -> Result<(), Answer> {
    let last = |step| Answer::Socket(step, io::Error::last_os_error());
    // SAFETY: socket(2) takes no pointers; a non-negative result is a new descriptor this
    // function then owns.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(last("open a socket"));
    }
    // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval {
        tv_sec: ANSWER.as_secs() as libc::time_t,
        tv_usec: 0,
    };
    // SAFETY: the option value points at a timeval that lives across the call, with its size.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            std::ptr::from_ref(&timeout).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(last("set a receive timeout"));
    }
    // SAFETY: an all-zero sockaddr_nl is valid; family set below, pid 0 is the kernel.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: `request` and `kernel` are valid for the lengths given for the whole call.
    let sent = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            request.as_ptr().cast(),
            request.len(),
            0,
            std::ptr::from_ref(&kernel).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(last("send the request"));
    }
    let mut reply = [0u8; 4096];
    loop {
        // SAFETY: `reply` is writable for its whole length during the call.
        let got = unsafe { libc::recv(fd.as_raw_fd(), reply.as_mut_ptr().cast(), reply.len(), 0) };
        if got < 0 {
            return Err(last("read the answer"));
        }
        if let Some(ack) = acknowledgement(&reply[..got as usize]) {
            return ack.map_err(Answer::Refused);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_are_parsed_and_bad_ones_refused() {
        assert_eq!(
            parse_mac("52:54:00:77:00:65").unwrap(),
            [0x52, 0x54, 0x00, 0x77, 0x00, 0x65]
        );
        for bad in [
            "",
            "52:54:00:77:00",
            "52:54:00:77:00:65:01",
            "52:54:00:77:00:6",
            "52-54-00-77-00-65",
            "zz:54:00:77:00:65",
            "01:00:5e:00:00:01", // multicast
            "00:00:00:00:00:00",
        ] {
            assert!(
                matches!(parse_mac(bad), Err(VfMacError::BadMac { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_request_has_ip_links_layout() {
        let request = set_vf_mac_request(7, 3, &[0x52, 0x54, 0, 0x77, 0, 0x65], 9);
        // nlmsghdr 16 + ifinfomsg 16 + VFINFO_LIST(4 + VF_INFO(4 + VF_MAC(4 + 36))) = 80.
        assert_eq!(request.len(), 80);
        let u16_at = |at: usize| u16::from_ne_bytes(request[at..at + 2].try_into().unwrap());
        let u32_at = |at: usize| u32::from_ne_bytes(request[at..at + 4].try_into().unwrap());
        assert_eq!(u32_at(0), 80);
        assert_eq!(u16_at(4), RTM_SETLINK);
        assert_eq!(u16_at(6), NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!(u32_at(8), 9);
        assert_eq!(u32_at(20), 7, "ifinfomsg.ifi_index");
        assert_eq!((u16_at(32), u16_at(34)), (48, IFLA_VFINFO_LIST));
        assert_eq!((u16_at(36), u16_at(38)), (44, IFLA_VF_INFO));
        assert_eq!((u16_at(40), u16_at(42)), (40, IFLA_VF_MAC));
        assert_eq!(u32_at(44), 3, "ifla_vf_mac.vf");
        assert_eq!(&request[48..54], &[0x52, 0x54, 0, 0x77, 0, 0x65]);
        assert!(request[54..80].iter().all(|&b| b == 0));
    }

    #[test]
    fn acknowledgements_are_read() {
        let ack = |kind: u16, error: i32| {
            let mut m = vec![0u8; 36];
            m[4..6].copy_from_slice(&kind.to_ne_bytes());
            m[16..20].copy_from_slice(&error.to_ne_bytes());
            m
        };
        assert!(matches!(
            acknowledgement(&ack(NLMSG_ERROR, 0)),
            Some(Ok(()))
        ));
        let refused = acknowledgement(&ack(NLMSG_ERROR, -libc::EOPNOTSUPP)).unwrap();
        assert_eq!(refused.unwrap_err().raw_os_error(), Some(libc::EOPNOTSUPP));
        assert!(acknowledgement(&ack(RTM_SETLINK, 0)).is_none());
        assert!(acknowledgement(&[0u8; 3]).is_none());
    }

    #[test]
    fn the_pf_the_index_and_the_netdev_come_from_sysfs() {
        let root = tempfile::tempdir().unwrap();
        let devices = root.path().join("bus/pci/devices");
        let pf = devices.join("0000:01:00.0");
        std::fs::create_dir_all(pf.join("net/enp1s0")).unwrap();
        std::fs::write(pf.join("net/enp1s0/ifindex"), "4\n").unwrap();
        for (index, vf) in ["0000:01:10.0", "0000:01:10.2"].iter().enumerate() {
            std::fs::create_dir_all(devices.join(vf)).unwrap();
            std::os::unix::fs::symlink("../0000:01:00.0", devices.join(vf).join("physfn")).unwrap();
            std::os::unix::fs::symlink(format!("../{vf}"), pf.join(format!("virtfn{index}")))
                .unwrap();
        }
        let sysfs = Sysfs::new(root.path());
        assert_eq!(
            VfTarget::find(&sysfs, "0000:01:10.2").unwrap(),
            VfTarget {
                pf: "0000:01:00.0".into(),
                netdev: "enp1s0".into(),
                ifindex: 4,
                index: 1
            }
        );
        // Not a VF: no physfn.
        assert!(matches!(
            VfTarget::find(&sysfs, "0000:01:00.0"),
            Err(VfMacError::Topology { .. })
        ));
        // A bad MAC is refused before anything is looked up or sent.
        assert!(matches!(
            set(&sysfs, "0000:01:10.0", "nonsense"),
            Err(VfMacError::BadMac { .. })
        ));
    }
}
