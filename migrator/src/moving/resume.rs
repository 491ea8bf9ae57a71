//! Phase `resume`: the agent on the destination resumes every connection on the new device.

use super::*;

impl Mover {
    pub(super) async fn resume_phase(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        if let Some(why) = self.strategy.steps().uncoordinated {
            return Ok(Finished::skipped(why));
        }
        // The guest now runs under the destination VMM; the source's channel is dead.
        self.agent = None;
        let ids = self.ids.clone();
        let endpoint = self.destination_endpoint()?;
        let resumed = self
            .destination()?
            .resume(&endpoint, &self.move_ref(), &ids, deadline)
            .await;
        let result = match resumed {
            Ok(result) => result,
            Err(e) => match (&e, &self.agent_lost) {
                // The move already went on without the agent: every connection is
                // recovering on its own, as the quiesce's forced path said.
                (StepError::Agent(_), Some(lost)) => {
                    let reason = format!(
                        "the agent did not resume either ({}; at the quiesce: {lost}): the \
                         connections recover through the library's own path (each reconnects \
                         by itself once its hold expires)",
                        error_chain(&e)
                    );
                    self.force(Phase::Resume, reason.clone());
                    return Ok(Finished {
                        outcome: PhaseOutcome::Forced { reason },
                        details: Map::new(),
                    });
                }
                _ => return Err(e),
            },
        };
        let details = self.record_outcomes(&result, "resumed");
        let failed: Vec<_> = result.failed().collect();
        let lost = (!failed.is_empty()).then(|| connections_lost(&failed, ids.len()));
        self.resume = result.outcomes;
        match lost {
            Some(error) => Err(error),
            None => Ok(Finished::ok(details)),
        }
    }
}
