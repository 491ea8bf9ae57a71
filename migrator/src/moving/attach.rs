//! Phase `attach`: the destination plugs the function (or the device) into the arrived VM.

use super::*;

impl Mover {
    pub(super) async fn attach(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        if let Some(why) = self.strategy.steps().device_moves {
            return Ok(Finished::skipped(why));
        }
        let destination = self.destination()?;
        let endpoint = self.destination_endpoint()?;
        let device = self.plan.attach.clone().ok_or(StepError::NotNamed {
            what: "the device to attach",
        })?;
        let function = self.function.as_ref().map(|(name, _)| name.as_str());
        let plugged = destination
            .attach(
                &endpoint,
                &self.move_ref(),
                function,
                &device,
                self.recovered_from.is_some(),
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
        details.insert("device".into(), plugged.id.into());
        if let Some(bdf) = plugged.bdf {
            details.insert("bdf".into(), bdf.into());
        }
        details.insert("driver".into(), plugged.driver.into());
        Ok(Finished::ok(details))
    }
}
