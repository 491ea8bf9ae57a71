//! Phase `migrate`: the VMM migrates the VM, progress is reported, the arrival confirmed.
//! When a workflow migrated (between `pre-migrate` and `post-migrate`), only the arrival is
//! confirmed.
//!
//! Strategy `hot` pauses the connections here, at the last moment before the switchover
//! ("wait before stop"): the VMM copies memory while the guest runs, holds the migration
//! short of its switchover ([`Vmm::send_migration_held`]), the agent pauses every
//! connection with its QP kept, and the VMM then stops the VM and moves it with the device.
//! A VMM that cannot hold a switchover (Cloud Hypervisor) is told to migrate once the
//! connections have paused.

use rdmamig_vmm::Held;

use super::*;

impl Mover {
    pub(super) async fn migrate(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        if self.plan.migration == MigrationBy::Workflow {
            return self.confirm_workflow_migrated(deadline).await;
        }
        let start = Instant::now();
        let source = self.source_vmm().await?;
        let mut details = Map::new();
        if self.strategy.steps().quiesce == QuiesceMode::Hot {
            self.pause_at_switchover(source.as_ref(), deadline, &mut details)
                .await?;
        } else {
            source
                .send_migration(&self.plan.via, &self.plan.limits)
                .await?;
        }
        let events = self.events.clone();
        let recorder_start = self.recorder.started_at();
        let mut last: Option<(Instant, MigrationStatus)> = None;
        let mut report = |progress: &MigrationProgress| {
            let due = match &last {
                None => true,
                Some((at, status)) => {
                    *status != progress.status || at.elapsed() >= PROGRESS_INTERVAL
                }
            };
            if due || progress.status.is_final() {
                last = Some((Instant::now(), progress.status.clone()));
                let _ = events.send(MoveEvent::Migration {
                    at_ms: millis(recorder_start.elapsed()),
                    progress: progress.clone(),
                });
            }
        };
        let done = match source
            .wait_migration(deadline.saturating_sub(start.elapsed()), &mut report)
            .await
        {
            Ok(done) => done,
            Err(failed @ VmmError::MigrationFailed { .. }) => {
                return Err(self.with_receivers_word(failed).await)
            }
            Err(e) => {
                if e.is_timeout() {
                    self.force(
                        Phase::Migrate,
                        format!(
                            "the migration did not complete within {} ms: cancelling it and \
                             rolling back",
                            millis(deadline)
                        ),
                    );
                }
                return Err(e.into());
            }
        };
        // The source let go of the VM: from here a rollback stops the destination and
        // resumes the source, whether or not the destination confirms.
        self.migrated = true;
        self.location = VmLocation::Destination;
        let confirm = Instant::now();
        let started = self
            .destination()?
            .confirm_received(
                &self.destination_endpoint()?,
                &self.move_ref(),
                deadline.saturating_sub(start.elapsed()),
            )
            .await?;
        self.journal.append(&Record::Migrated)?;
        details.insert("confirm_ms".into(), millis(confirm.elapsed()).into());
        // From the source's stop to the destination's start: the VMM's downtime ends with
        // the send, before the destination runs the guest.
        if let Some(paused) = vm_paused(done.vm_stopped_at, started) {
            details.insert("vm_paused_ms".into(), millis(paused).into());
        }
        for (key, value) in [
            ("vmm_total_ms", done.total_time_ms),
            ("downtime_ms", done.downtime_ms),
            ("setup_ms", done.setup_time_ms),
            ("ram_transferred", done.ram_transferred),
        ] {
            if let Some(value) = value {
                details.insert(key.into(), value.into());
            }
        }
        self.migration = Some(done);
        Ok(Finished::ok(details))
    }

    /// Strategy `hot`: starts the migration held short of its switchover, pauses every
    /// connection (their QPs kept), then lets the VMM switch over. A pause that fails, or
    /// comes too late, is a forced path: each connection is confirmed on its QP after the
    /// move, and reconnects with replay if the QP did not survive.
    async fn pause_at_switchover(
        &mut self,
        source: &dyn Vmm,
        deadline: Duration,
        details: &mut Map<String, Value>,
    ) -> Result<(), StepError> {
        let (via, limits) = (self.plan.via.clone(), self.plan.limits);
        let held = match source.send_migration_held(&via, &limits, deadline).await {
            Ok(held) => Some(held),
            Err(VmmError::Unsupported { reason, .. }) => {
                details.insert("switchover".into(), format!("not held: {reason}").into());
                None
            }
            Err(e) => return Err(e.into()),
        };
        if held == Some(Held::SwitchedOver) {
            self.force(
                Phase::Migrate,
                "the VMM switched over before the connections could pause (the guest dirtied \
                 no memory in a pass: no traffic moved); each is confirmed on its QP after \
                 the move"
                    .into(),
            );
            details.insert("paused".into(), 0.into());
            return Ok(());
        }
        let pause = Instant::now();
        let quiesce = self.deadline(Phase::Quiesce);
        let paused = self
            .quiesce_connections(Phase::Migrate, QuiesceMode::Hot, quiesce)
            .await?;
        details.insert("pause_ms".into(), millis(pause.elapsed()).into());
        for (key, value) in paused.details {
            let key = match key.as_str() {
                "quiesced" => "paused".to_string(),
                other => format!("pause_{other}"),
            };
            details.insert(key, value);
        }
        match held {
            Some(_) => {
                source.release_switchover(&limits).await?;
                details.insert("switchover".into(), "held until the pause".into());
            }
            None => source.send_migration(&via, &limits).await?,
        }
        Ok(())
    }

    /// The workflow migrated the VM: confirm that it runs on the destination. A VM that
    /// did not arrive there is still the source's, and the move rolls back.
    async fn confirm_workflow_migrated(
        &mut self,
        deadline: Duration,
    ) -> Result<Finished, StepError> {
        let start = Instant::now();
        let destination = self.destination_endpoint()?;
        self.destination()?
            .confirm_received(&destination, &self.move_ref(), deadline)
            .await?;
        self.migrated = true;
        self.location = VmLocation::Destination;
        self.journal.append(&Record::Migrated)?;
        let mut details = Map::new();
        details.insert("migrated_by".into(), "workflow".into());
        details.insert("confirm_ms".into(), millis(start.elapsed()).into());
        Ok(Finished::ok(details))
    }

    /// A failed migration, with what the receiving VMM said when this host holds its
    /// receive: Cloud Hypervisor's `migration-failed` event names no cause, and the
    /// receiver's error chain often does (NOTES.md).
    async fn with_receivers_word(&mut self, failed: VmmError) -> StepError {
        let VmmError::MigrationFailed { status, reason } = failed else {
            return failed.into();
        };
        let said = match (self.destination(), self.destination_endpoint()) {
            (Ok(destination), Ok(endpoint)) => destination
                .confirm_received(&endpoint, &self.move_ref(), RECEIVERS_WORD)
                .await
                .err(),
            _ => None,
        };
        let reason = match said {
            Some(StepError::Vmm(VmmError::MigrationFailed { reason: said, .. }))
                if !reason.contains(&said) =>
            {
                format!("{reason}; the receiver: {said}")
            }
            _ => reason,
        };
        VmmError::MigrationFailed { status, reason }.into()
    }
}
