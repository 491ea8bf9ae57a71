//! The rollback: undoes a move that failed before the point of no return (cancel or undo
//! the migration, wait for a pending unplug, plug the device back, resume on the source).

use super::*;

impl Mover {
    /// Runs the rollback phase; the move ends `rolled_back`, or `failed` if the rollback
    /// itself fails. `Ok` only in the sense that the state machine accepted the steps.
    pub(super) async fn finish_rollback(&mut self, failed: Phase) -> RunResult {
        let deadline = self.deadline(Phase::Rollback);
        if let Some(hook) = &self.context.boundary {
            hook(Phase::Rollback);
        }
        let started = self.recorder.begin(Phase::Rollback, millis(deadline));
        self.emit(MoveEvent::PhaseStarted {
            phase: Phase::Rollback,
            unix_ms: started,
            at_ms: self.recorder.elapsed_ms(),
            deadline_ms: millis(deadline),
        });
        let mut steps = Vec::new();
        let result = self.undo(&mut steps, deadline).await;
        let mut details = Map::new();
        details.insert("failed_phase".into(), failed.name().into());
        details.insert(
            "steps".into(),
            Value::Array(steps.into_iter().map(Value::from).collect()),
        );
        match result {
            Ok(()) => {
                self.end_phase(PhaseOutcome::Ok, details);
                self.phase = transition(self.phase, Phase::RolledBack)
                    .map_err(|e| (self.phase, e.into()))?;
                Ok(())
            }
            Err(cause) => {
                let text = error_chain(&cause);
                self.end_phase(
                    PhaseOutcome::Failed {
                        error: text.clone(),
                    },
                    details,
                );
                self.rollback_error = Some(text);
                self.phase =
                    transition(self.phase, Phase::Failed).map_err(|e| (self.phase, e.into()))?;
                Ok(())
            }
        }
    }

    /// Puts the VM back on the source as it was before the move, step by step from how far
    /// the move got; every step first checks whether it is still needed (a restarted
    /// migrator may repeat it).
    ///
    /// Undoing the migration, and plugging and resuming on the source, each have `deadline`.
    /// Between them, waiting for an unplug the guest has not finished has a bound of its own
    /// (`deadline` again): a slow removal must not eat the time the resume needs.
    pub(super) async fn undo(
        &mut self,
        steps: &mut Vec<String>,
        deadline: Duration,
    ) -> Result<(), StepError> {
        within(deadline, self.undo_migration(steps)).await?;
        if self.unplugging {
            self.await_pending_removal(steps, deadline).await?;
        }
        within(deadline, self.undo_on_source(steps, deadline)).await
    }

    /// Brings the VM back to the source VMM if the migration started: cancels it or, if it
    /// completed, discards the destination's copy and runs the source again.
    pub(super) async fn undo_migration(
        &mut self,
        steps: &mut Vec<String>,
    ) -> Result<(), StepError> {
        if self.reached >= Phase::Migrate {
            let source = self.source_vmm().await?;
            if !self.migrated {
                let cancelled = match source.cancel_migration().await {
                    Ok(()) => true,
                    // Cloud Hypervisor cannot cancel: the migration ends by itself (failed, or
                    // its own timeout limit with the Cancel strategy), which the wait sees.
                    Err(e @ VmmError::Unsupported { .. }) => {
                        self.warn(format!("{e}: waiting for the migration to end"));
                        false
                    }
                    Err(e) => return Err(e.into()),
                };
                // Wait until the migration is over, not just asked to stop: a VMM refuses
                // hot-plug while a cancelled migration is still winding down. It may also
                // have completed before the cancel took.
                let mut ignore = |_: &MigrationProgress| {};
                match source
                    .wait_migration(self.deadline(Phase::Rollback), &mut ignore)
                    .await
                {
                    Ok(_) => self.migrated = true,
                    // Cancelled or failed: over. Protocol: none was running (a migrator
                    // killed before it started one).
                    Err(VmmError::MigrationFailed { .. } | VmmError::Protocol { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
                let end = Instant::now() + self.deadline(Phase::Rollback);
                loop {
                    let status = source.status().await?;
                    match status.phase {
                        VmPhase::Migrated | VmPhase::NoVm => {
                            self.migrated = true;
                            break;
                        }
                        VmPhase::Running | VmPhase::Paused => break,
                        _ if Instant::now() >= end => {
                            return Err(StepError::VmState {
                                side: "source",
                                state: status.state,
                                expected: "still migrating after the cancel",
                            })
                        }
                        _ => tokio::time::sleep(CANCEL_POLL).await,
                    }
                }
                if !self.migrated {
                    steps.push(if cancelled {
                        "migration cancelled".into()
                    } else {
                        "migration over without completing (the VMM cannot cancel)".into()
                    });
                }
            }
            if self.migrated {
                let deadline = self.deadline(Phase::Rollback);
                let endpoint = self.destination_endpoint()?;
                self.destination()?
                    .discard(&endpoint, &self.move_ref(), deadline)
                    .await?;
                steps.push("destination VMM stopped (the migrated copy is discarded)".into());
                if !source.status().await?.running {
                    source.resume().await?;
                }
                steps.push("source VM running again".into());
                self.migrated = false;
            }
            self.location = VmLocation::Source;
        }
        Ok(())
    }

    /// Waits, up to `bound`, until the source no longer lists the detached device.
    ///
    /// A device_del cannot be taken back: a guest whose process held the device finishes
    /// the removal it was asked for once the process lets go, however late. Plugging
    /// nothing because the device is "still there" would leave the VM without its NIC then;
    /// so the rollback waits for the removal to end, and only then plugs the function again.
    pub(super) async fn await_pending_removal(
        &mut self,
        steps: &mut Vec<String>,
        bound: Duration,
    ) -> Result<(), StepError> {
        let source = self.source_vmm().await?;
        let device = self.plan.detach.clone();
        let start = Instant::now();
        if !within(bound, source.has_device(&device)).await? {
            return Ok(());
        }
        self.warn(format!(
            "device {device} is still on the source, its unplug pending in the guest: waiting \
             up to {} ms for the guest to finish removing it before plugging it again",
            millis(bound)
        ));
        loop {
            tokio::time::sleep(REMOVAL_POLL).await;
            let left = bound.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(StepError::RemovalPending {
                    device,
                    waited_ms: millis(start.elapsed()),
                });
            }
            // A question the bound cuts short is not an answer: the next round says the
            // removal is still pending (a busy VMM once turned that into "a step did not
            // return in time", which named nothing).
            match within(left, source.has_device(&device)).await {
                Ok(true) | Err(StepError::Stalled) => {}
                Ok(false) => {
                    steps.push(format!(
                        "waited {} ms for the guest to finish removing device {device}",
                        millis(start.elapsed())
                    ));
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The device to plug back on the source: `--reattach`; else the source function (a
    /// VF by its PCI address) with the `--attach` properties; else `--attach` itself.
    fn reattach_device(&self) -> Result<rdmamig_vmm::DeviceSpec, StepError> {
        let spec = self.plan.reattach_spec().ok_or(StepError::NotNamed {
            what: "the device to plug back on the source (pre-migrate --reattach)",
        })?;
        let function = self.plan.source_function.as_deref();
        match function.and_then(|name| self.context.pool.attachment(name)) {
            Some(attachment) if self.plan.reattach.is_none() => {
                Ok(crate::pool::device_for(&attachment, spec))
            }
            _ => Ok(spec.clone()),
        }
    }

    /// Plugs the device back on the source, resumes the connections there, and gives back
    /// the destination's function.
    pub(super) async fn undo_on_source(
        &mut self,
        steps: &mut Vec<String>,
        deadline: Duration,
    ) -> Result<(), StepError> {
        let stage = Instant::now();
        let reached = self.reached;
        let steps_of = self.strategy.steps();
        if reached >= Phase::Detach && steps_of.device_moves.is_none() {
            let source = self.source_vmm().await?;
            let spec = self.reattach_device()?;
            if source.has_device(spec.id()).await? {
                steps.push(format!("device {} already back on the source", spec.id()));
            } else {
                source.add_device(&spec).await?;
                steps.push(format!("device {} re-attached on the source", spec.id()));
            }
        }
        if reached >= Phase::Quiesce && steps_of.uncoordinated.is_none() {
            // A fresh session: the old one may hold requests the agent never answered.
            self.agent = None;
            let source = self.source_vmm().await?;
            // A NIC plugged again must come up before anything reconnects: the resume gets
            // what is left of the rollback's deadline (but the time to give back a function).
            let reserve = if self.function.is_some() {
                RELEASE_RESERVE
            } else {
                Duration::ZERO
            };
            let budget = deadline
                .saturating_sub(stage.elapsed())
                .saturating_sub(reserve);
            let start = Instant::now();
            let (mut agent, _) =
                open_agent(self.context.backends.as_ref(), source.as_ref(), budget).await?;
            let result = agent
                .resume(&self.ids, budget.saturating_sub(start.elapsed()))
                .await?;
            self.resume = result.outcomes.clone();
            let failed: Vec<_> = result.failed().collect();
            if !failed.is_empty() {
                return Err(connections_lost(&failed, self.ids.len()));
            }
            steps.push(format!(
                "{} connections resumed on the source",
                result.outcomes.len()
            ));
        }
        if let Some((function, _)) = self.function.clone() {
            let destination = self.destination()?;
            let deadline = self.deadline(Phase::Rollback);
            destination
                .release(&function, &self.move_ref(), deadline)
                .await?;
            steps.push(format!(
                "function {function} released to the destination's pool ({})",
                destination.describe()
            ));
        }
        Ok(())
    }
}
