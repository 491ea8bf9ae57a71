//! Phase `quiesce`: the agent quiesces every connection (a silent agent or a failed
//! connection is a forced path, and the move goes on). The guest's answer is not believed
//! beyond what it says: a listed connection it leaves out was not quiesced. Strategy `hot`
//! pauses its connections the same way ([`Mover::quiesce_connections`]), but later: in the
//! migrate phase, right before the switchover.

use super::*;

impl Mover {
    pub(super) async fn quiesce_phase(
        &mut self,
        deadline: Duration,
    ) -> Result<Finished, StepError> {
        if let Some(why) = self.strategy.steps().uncoordinated {
            return Ok(Finished::skipped(why));
        }
        let mode = self.strategy.steps().quiesce;
        // A workflow migrates the VM itself, so the switchover cannot be held: a `hot`
        // move then pauses its connections here, before the hand-over.
        if mode == QuiesceMode::Hot && self.plan.migration == MigrationBy::Migrator {
            return Ok(Finished::skipped(
                "strategy hot: the connections pause right before the switchover, in the \
                 migrate phase",
            ));
        }
        self.quiesce_connections(Phase::Quiesce, mode, deadline)
            .await
    }

    /// Asks the agent to quiesce every connection as `mode` says; what did not quiesce is a
    /// forced path of `phase`, the one the move is in.
    pub(super) async fn quiesce_connections(
        &mut self,
        phase: Phase,
        mode: QuiesceMode,
        deadline: Duration,
    ) -> Result<Finished, StepError> {
        let ids = self.ids.clone();
        let result = match self.agent.as_mut() {
            Some(agent) => agent.quiesce(&ids, deadline, mode).await,
            None => {
                let source = self.source_vmm().await?;
                let mut agent = self.context.backends.agent(source.as_ref()).await?;
                let result = agent.quiesce(&ids, deadline, mode).await;
                self.agent = Some(agent);
                result
            }
        };
        let mut result = match result {
            Ok(result) => result,
            Err(e) => {
                // The agent is silent or broken: the move goes on, and every connection
                // recovers through the library's own path (device gone, wait for the peer,
                // replay).
                let reason = format!(
                    "the agent did not quiesce ({}); going on without a coordinated quiesce",
                    error_chain(&e)
                );
                self.agent = None;
                self.agent_lost = Some(error_chain(&e));
                self.force(phase, reason.clone());
                return Ok(Finished {
                    outcome: PhaseOutcome::Forced { reason },
                    details: Map::new(),
                });
            }
        };
        let mut details = self.record_outcomes(&result, "quiesced");
        for id in &ids {
            if !result.outcomes.iter().any(|o| o.id == *id) {
                result.outcomes.push(ConnectionOutcome {
                    id: *id,
                    ok: false,
                    elapsed_ms: 0,
                    error: Some("the agent's answer left it out: not quiesced".into()),
                    fell_back: None,
                });
            }
        }
        details.insert("failed".into(), result.failed().count().into());
        let failed: Vec<String> = result
            .failed()
            .map(|f| {
                format!(
                    "{:016x}: {}",
                    f.id,
                    f.error.as_deref().unwrap_or("no reason given")
                )
            })
            .collect();
        self.quiesce = result.outcomes;
        if failed.is_empty() {
            return Ok(Finished::ok(details));
        }
        let reason = format!(
            "{} connections did not quiesce ({}); going on anyway",
            failed.len(),
            failed.join("; ")
        );
        self.force(phase, reason.clone());
        Ok(Finished {
            outcome: PhaseOutcome::Forced { reason },
            details,
        })
    }
}
