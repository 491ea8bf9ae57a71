//! Phase `detach`: unmanaged programs dealt with by the policy, then the unplug (with the
//! forced release when allowed), and the source function's reset.

use super::*;

impl Mover {
    pub(super) async fn detach(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        if let Some(why) = self.strategy.steps().device_moves {
            return Ok(Finished::skipped(why));
        }
        let source = self.source_vmm().await?;
        let mut details = Map::new();
        let mut outcome = PhaseOutcome::Ok;
        self.settle_unmanaged(deadline, &mut details).await?;
        self.journal.append(&Record::Unplugging)?;
        self.unplugging = true;
        match source.remove_device(&self.plan.detach, deadline).await {
            Ok(()) => {}
            Err(e) if e.is_timeout() && self.unmanaged_policy() == UnmanagedPolicy::Release => {
                let (holders, reason) = self.force_release(deadline).await?;
                outcome = PhaseOutcome::Forced { reason };
                details.insert(
                    "forced_release".into(),
                    serde_json::to_value(&holders).unwrap_or_default(),
                );
                // The unplug is still pending in the VMM: wait for it again.
                source.remove_device(&self.plan.detach, deadline).await?;
            }
            Err(e) if e.is_timeout() => {
                self.force(
                    Phase::Detach,
                    format!(
                        "the guest did not release {} within {} ms (an application holds its \
                         device context): rolling back",
                        self.plan.detach,
                        millis(deadline)
                    ),
                );
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        }
        details.insert("device".into(), self.plan.detach.clone().into());
        if let Some(name) = self.plan.source_function.clone() {
            let result = self.reset_source_function(&name);
            let text = match &result {
                Ok(done) => done.clone(),
                Err(e) => format!("FAILED: {e}"),
            };
            details.insert("reset".into(), text.into());
            self.source_reset = Some(result);
        }
        Ok(Finished { outcome, details })
    }

    /// Right before the unplug, the unmanaged programs again (the quiesce may have taken a
    /// while): under `release` they are ended now; under `refuse` one that started since
    /// prepare fails the phase, which rolls back with the device still plugged. Without an
    /// agent (a forced quiesce) there is no one to ask, and the unplug goes on.
    pub(super) async fn settle_unmanaged(
        &mut self,
        deadline: Duration,
        details: &mut Map<String, Value>,
    ) -> Result<(), StepError> {
        let policy = self.unmanaged_policy();
        if self.strategy.steps().uncoordinated.is_some() {
            return Ok(());
        }
        let Some(agent) = self.agent.as_mut() else {
            return Ok(());
        };
        let programs = match agent.list_unmanaged(deadline).await {
            Ok(programs) => programs,
            Err(e) => {
                self.warn(format!(
                    "the agent could not list unmanaged programs before the unplug ({}); \
                     unplugging",
                    error_chain(&e)
                ));
                return Ok(());
            }
        };
        if programs.is_empty() {
            return Ok(());
        }
        let new = self.unmanaged.add(programs);
        match policy {
            // Prepare refused any found then: these all started since.
            UnmanagedPolicy::Refuse => Err(self.refusal(" (started since prepare)")),
            UnmanagedPolicy::Release => {
                let holders = agent
                    .release_device(ReleaseScope::Unmanaged, RELEASE_GRACE, deadline)
                    .await?;
                self.unmanaged.released(&holders);
                details.insert(
                    "ended".into(),
                    serde_json::to_value(&holders).unwrap_or_default(),
                );
                Ok(())
            }
            UnmanagedPolicy::Ignore => {
                if new > 0 {
                    self.warn(format!(
                        "unmanaged programs started since prepare (policy ignore): {}",
                        self.unmanaged.named()
                    ));
                }
                Ok(())
            }
        }
    }

    pub(super) fn refusal(&self, since: &'static str) -> StepError {
        StepError::UnmanagedPrograms {
            count: self.unmanaged.len(),
            since,
            named: self.unmanaged.named(),
        }
    }

    /// The forced release (`--unmanaged release`), after the unplug missed its deadline: the
    /// agent makes every process that holds the RDMA device let go, and the forced path is
    /// recorded with each holder's PID, name and what was done to it.
    pub(super) async fn force_release(
        &mut self,
        deadline: Duration,
    ) -> Result<(Vec<DeviceHolder>, String), StepError> {
        let mut agent = match self.agent.take() {
            Some(agent) => agent,
            None => {
                let source = self.source_vmm().await?;
                self.context.backends.agent(source.as_ref()).await?
            }
        };
        let holders = agent
            .release_device(ReleaseScope::AllHolders, RELEASE_GRACE, deadline)
            .await;
        self.agent = Some(agent);
        let holders = holders?;
        let named = if holders.is_empty() {
            "the agent found no process holding an RDMA device".to_string()
        } else {
            holders
                .iter()
                .map(|h| {
                    format!(
                        "PID {} ({}): {}{}",
                        h.pid,
                        h.program,
                        h.action,
                        if h.released { "" } else { ", still holding it" }
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        let reason = format!(
            "the guest did not release {} within {} ms (a process holds its device context): \
             forced release (--unmanaged release): {named}",
            self.plan.detach,
            millis(deadline)
        );
        self.force(Phase::Detach, reason.clone());
        Ok((holders, reason))
    }

    /// Resets the source's detached function, so that it stops processing whatever was
    /// still posted to it, before it may go back to the pool.
    pub(super) fn reset_source_function(&self, name: &str) -> Result<String, String> {
        match self.context.pool.attachment(name) {
            Some(attachment) => crate::pool::reset(&attachment),
            None => Err(format!("no function {name} in this host's pool")),
        }
    }
}
