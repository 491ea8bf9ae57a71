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
        let mut details = self.record_outcomes(&result, "resumed");
        let fell_back: Vec<String> = result
            .outcomes
            .iter()
            .filter_map(|o| Some(format!("{:016x}: {}", o.id, o.fell_back.as_deref()?)))
            .collect();
        if self.strategy.steps().quiesce == QuiesceMode::Hot {
            // The QPs the move kept, and those that did not survive it (they reconnected).
            details.insert("fell_back".into(), fell_back.len().into());
            if !fell_back.is_empty() {
                self.warn(format!(
                    "{} connections reconnected instead of going on on their QP: {}",
                    fell_back.len(),
                    fell_back.join("; ")
                ));
                details.insert("fell_back_connections".into(), fell_back.into());
            }
        }
        let failed: Vec<_> = result.failed().collect();
        let lost = (!failed.is_empty()).then(|| connections_lost(&failed, ids.len()));
        self.resume = result.outcomes;
        match lost {
            Some(error) => Err(error),
            None => Ok(Finished::ok(details)),
        }
    }
}
