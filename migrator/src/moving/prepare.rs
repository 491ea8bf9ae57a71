//! Phase `prepare`: journal the strategy chosen at admission, check the source, list the connections and the
//! unmanaged programs, reserve a function, ready the destination. Nothing in the VM changes.

use super::*;

impl Mover {
    pub(super) async fn prepare(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        let start = Instant::now();
        let mut details = Map::new();
        // Decided when the move was admitted, before anything acts: journaled first.
        if let Some(choice) = self.chosen.clone() {
            self.journal.append(&Record::Chose {
                choice: choice.clone(),
            })?;
            details.insert("strategy".into(), choice.strategy.to_string().into());
            if self.plan.strategy != choice.strategy {
                details.insert("strategy_reason".into(), choice.reason.into());
            }
        }
        let source = self.source_vmm().await?;
        let status = source.status().await?;
        if !matches!(status.phase, VmPhase::Running | VmPhase::Paused) {
            return Err(StepError::VmState {
                side: "source",
                state: status.state,
                expected: "not a VM that can migrate (neither running nor paused)",
            });
        }
        details.insert("source_state".into(), status.state.into());
        // A workflow's move has no destination yet: post-migrate names it.
        let destination = match self.plan.migration {
            MigrationBy::Migrator => Some(self.destination()?),
            MigrationBy::Workflow => None,
        };
        if let Some(destination) = &destination {
            details.insert("destination".into(), destination.describe().into());
        }
        // hot plugs nothing: a QEMU destination was started with the device; a Cloud
        // Hypervisor one is handed the reserved function with its receive.
        let hand_over_at_receive = self.hands_over_at_receive();
        let reserve = self.plan.from_pool
            && (self.strategy.steps().device_moves.is_none() || hand_over_at_receive);
        if let Some(destination) = destination.as_ref().filter(|_| reserve) {
            let (function, attachment) = destination
                .reserve(&self.move_ref(), deadline.saturating_sub(start.elapsed()))
                .await?;
            self.journal.append(&Record::Reserved {
                function: function.clone(),
                attachment: attachment.clone(),
            })?;
            details.insert("function".into(), function.clone().into());
            self.function = Some((function, attachment));
        }
        // The guest before the destination VMM is readied, which cannot be taken back: a
        // refusal (unmanaged programs) leaves it as it was (a reservation is released).
        if self.strategy.steps().uncoordinated.is_none() {
            let (mut agent, version) = open_agent(
                self.context.backends.as_ref(),
                source.as_ref(),
                deadline.saturating_sub(start.elapsed()),
            )
            .await?;
            let connections = agent
                .list_connections(deadline.saturating_sub(start.elapsed()))
                .await?;
            details.insert("agent_version".into(), version.into());
            details.insert("connections".into(), connections.len().into());
            self.ids = connections.iter().map(|c| c.id).collect();
            self.journal.append(&Record::Listed {
                connections: self.ids.clone(),
            })?;
            self.connections = connections;
            let programs = agent
                .list_unmanaged(deadline.saturating_sub(start.elapsed()))
                .await;
            self.agent = Some(agent);
            let programs = programs?;
            details.insert("unmanaged".into(), programs.len().into());
            self.unmanaged.add(programs);
            if !self.unmanaged.is_empty() && self.strategy.steps().device_moves.is_some() {
                // Their device moves with the VM: nothing of theirs is torn down, they are
                // only not paused.
                self.warn(format!(
                    "unmanaged programs, not paused (their device moves with the VM): {}",
                    self.unmanaged.named()
                ));
            } else if !self.unmanaged.is_empty() {
                self.warn(format!(
                    "unmanaged programs (policy {}): {}",
                    self.unmanaged_policy(),
                    self.unmanaged.named()
                ));
                if self.unmanaged_policy() == UnmanagedPolicy::Refuse {
                    return Err(self.refusal(""));
                }
            }
        }
        if let Some(destination) = destination {
            let hand_over =
                self.function
                    .as_ref()
                    .filter(|_| hand_over_at_receive)
                    .map(|(function, _)| HandOver {
                        device: self.plan.detach.clone(),
                        function: function.clone(),
                    });
            destination
                .prepare_receive(
                    &self.destination_endpoint()?,
                    &self.move_ref(),
                    &self.plan.via,
                    hand_over.as_ref(),
                    deadline.saturating_sub(start.elapsed()),
                )
                .await?;
            details.insert("via".into(), self.plan.via.clone().into());
            if let Some(hand_over) = hand_over {
                details.insert("handed_over".into(), hand_over.function.into());
            }
        }
        Ok(Finished::ok(details))
    }
}
