//! Phase `attach`: the destination plugs the function (or the device) into the arrived VM.

use super::*;

impl Mover {
    pub(super) async fn attach(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        let device = match self.strategy.steps().device_moves {
            // The device came with the VM, into the function handed to the receiving VMM:
            // the attach finds it there and records the function as attached.
            Some(_) if self.function.is_some() => {
                DeviceSpec::parse(&format!("driver=vfio-pci,id={}", self.plan.detach)).map_err(
                    |_| StepError::NotNamed {
                        what: "the device that moved (--detach ID)",
                    },
                )?
            }
            Some(why) => return Ok(Finished::skipped(why)),
            None => self.plan.attach.clone().ok_or(StepError::NotNamed {
                what: "the device to attach",
            })?,
        };
        let destination = self.destination()?;
        let endpoint = self.destination_endpoint()?;
        let device_moved = self.strategy.steps().device_moves.is_some();
        let check_first = self.recovered_from.is_some() || device_moved;
        let function = self.function.as_ref().map(|(name, _)| name.as_str());
        let host_pci = match &self.function {
            Some((_, Attachment::Vfio { pci })) => Some(pci.clone()),
            _ => None,
        };
        let plugged = destination
            .attach(
                &endpoint,
                &self.move_ref(),
                function,
                &device,
                check_first,
                deadline,
            )
            .await?;
        let mut details = Map::new();
        if plugged.already {
            details.insert("already_attached".into(), true.into());
        }
        if let Some(function) = function {
            details.insert("function".into(), function.into());
        }
        if let Some(pci) = host_pci {
            details.insert("pci".into(), pci.into());
        }
        details.insert("device".into(), plugged.id.into());
        if let Some(bdf) = plugged.bdf {
            details.insert("guest_bdf".into(), bdf.into());
        }
        details.insert("driver".into(), plugged.driver.into());
        Ok(Finished::ok(details))
    }
}
