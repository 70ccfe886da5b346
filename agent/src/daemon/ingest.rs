//! Kernel batches into the ledger (CNI runs), the model (netns records) and
//! the metrics; ring-buffer losses and CNI runs that vanished without an
//! exit record.

use std::time::SystemTime;

use super::{Agent, triggers::Reason};
use crate::{
    kernel::{
        events::{DecodeError, KernelEvent},
        stream::KernelStream,
    },
    ledger::persist::Window,
};

/// A CNI run whose exit record ended it.
struct EndedRun {
    /// The container it ran for; None when the kernel could not name it
    /// whole (then it may concern any).
    container: Option<String>,
    succeeded: bool,
}

impl Agent {
    /// Ingests a batch; CNI runs that finished in it go to the triggers.
    pub(super) async fn on_kernel_batch(&mut self, batch: Vec<Result<KernelEvent, DecodeError>>) -> anyhow::Result<()> {
        // A death pass's lines come before anything learned after it.
        self.publish_deferred()?;
        // The batch's events go out in one write (a CNI run's exec and
        // exits often come together), before anything awaits.
        self.events.hold();
        let ingested = self.ingest(batch);
        self.events.release()?;
        let (netns_records, ledger_changed) = ingested?;
        if !netns_records.is_empty() {
            self.model.kernel_events(netns_records).await?;
        }
        if ledger_changed {
            // /state's copy of the ledger is made again at the next
            // reconcile or housekeeping tick, the knowledge file at the next
            // tick: not for the netns records that change neither.
            self.attachments_dirty = true;
            self.memory.dirty = true;
        }
        Ok(())
    }

    /// The batch into the ledger and the event stream; returns the records
    /// for the model and whether the ledger changed.
    fn ingest(&mut self, batch: Vec<Result<KernelEvent, DecodeError>>) -> anyhow::Result<(Vec<KernelEvent>, bool)> {
        let mut netns_records = Vec::new();
        let mut ledger_changed = false;
        for record in batch {
            let event = match record {
                Ok(event) => event,
                Err(e) => {
                    self.publish_malformed(&e)?;
                    continue;
                }
            };
            if self.admit_cni_run(&event)? {
                ledger_changed |= matches!(event, KernelEvent::CniExec { .. } | KernelEvent::CniExit { .. });
                if let Some(ended) = self.record_cni_run(&event) {
                    self.triggers.cni_exited(ended.container.as_deref(), !ended.succeeded);
                }
            }
            self.publish_kernel_event(&event)?;
            // The model reads netns records only: a CNI run's records would
            // cost a wake-up of its task each, for nothing.
            if !matches!(event, KernelEvent::CniExec { .. } | KernelEvent::CniExit { .. }) {
                netns_records.push(event);
            }
        }
        Ok((netns_records, ledger_changed))
    }

    /// Ingests what the probes wrote without waking the agent (a DEL's exec
    /// record waits for its exit, a nested run's records for its parent's
    /// exit): every decision, and every tick, first sees every record the
    /// kernel wrote before it.
    pub(super) async fn catch_up(&mut self, kernel: &mut KernelStream) -> anyhow::Result<()> {
        // Every turn of the event loop but a kernel batch's starts here: a
        // death pass held back for its release is published first.
        self.publish_deferred()?;
        let batch = kernel.pending();
        if batch.is_empty() {
            return Ok(());
        }
        self.on_kernel_batch(batch).await
    }

    /// A CNI run's record into the ledger; when it ended a run, which run
    /// and whether it succeeded.
    fn record_cni_run(&mut self, event: &KernelEvent) -> Option<EndedRun> {
        if let (Some(k), KernelEvent::CniExec { task, exec }) = (self.kube.as_mut(), event)
            && let Some(cid) = exec.container_id.as_ref().filter(|c| !c.truncated)
        {
            k.on_cni_exec(task.tgid, &cid.value, exec.cni_args.as_ref());
        }
        // An exit of a run whose container is unknown (its environment was
        // not read that far) ends no attachment but ends a run all the same.
        let ended = match event {
            KernelEvent::CniExit { task, .. } => self.ledger.running_for(task.tgid),
            _ => None,
        };
        let clock = self.clock;
        let att = self.ledger.observe(event, |k| clock.wall(k), &self.resolver);
        let KernelEvent::CniExit { task, exit } = event else { return None };
        let container = ended?;
        if let Some(op) = att.and_then(|a| a.operations.iter().rev().find(|op| op.pid == task.tgid)) {
            self.metrics.cni_operation(&op.command, op.result());
        }
        Some(EndedRun { container, succeeded: exit.succeeded() })
    }

    /// The CNI-run filter, before the ledger: false for an exec record that
    /// is not a CNI plugin run (reported as an anomaly; the ledger never
    /// sees it). A run whose environment scan was cut short is counted.
    fn admit_cni_run(&mut self, event: &KernelEvent) -> anyhow::Result<bool> {
        let KernelEvent::CniExec { exec, .. } = event else { return Ok(true) };
        if let Err(anomaly) = self.cni_filter.admit(event) {
            self.publish_cni_anomaly(event, &anomaly)?;
            return Ok(false);
        }
        if exec.env_scan_limited {
            self.publish_env_scan_limited(event);
        }
        Ok(true)
    }

    /// Once a second: /state's ledger, the saved knowledge (at most every
    /// `knowledge::SAVE_INTERVAL`), ring-buffer
    /// losses, and CNI runs whose process is gone without an exit record.
    pub(super) async fn housekeeping(&mut self, kernel: &mut KernelStream) -> anyhow::Result<()> {
        self.catch_up(kernel).await?;
        // Bounded ledger (issue 13.3, helper `model`): forget containers
        // whose bound netns died, once past an age limit that is never less
        // than the orphan grace (`ledger::dead_binding_max_age` says why).
        let max_age = crate::ledger::dead_binding_max_age(self.policy.orphan_grace);
        if self.ledger.forget_dead_bindings(SystemTime::now(), max_age) > 0 {
            self.attachments_dirty = true;
            self.memory.dirty = true;
        }
        self.publish_attachments();
        self.save_knowledge_when_due().await;
        let _ = crate::release::lastlook::drain_between_looks();
        let dropped = kernel.new_drops()?;
        if dropped > 0 {
            // Something may be missing from the ledger: from now on, youth
            // grace again, and re-read the model.
            let now = SystemTime::now();
            self.memory.windows.push(Window { since: self.watching_since, until: now });
            self.watching_since = now;
            self.publish_records_dropped(dropped)?;
            self.model.resync().await?;
        }
        // A plugin is gone from /proc as soon as its parent reaps it, which
        // can be before its exit record (already in the ring buffer) is
        // read: a run counts as vanished only when its process was gone at
        // the previous tick too, so its exit code is not lost to a race.
        let gone_before = std::mem::take(&mut self.gone_at_last_tick);
        let gone_now = std::cell::RefCell::new(std::collections::HashSet::new());
        let vanished = self.ledger.reap_vanished(SystemTime::now(), |pid| {
            if std::path::Path::new(&format!("/proc/{pid}")).exists() {
                return true;
            }
            gone_now.borrow_mut().insert(pid);
            !gone_before.contains(&pid)
        });
        self.gone_at_last_tick = gone_now.into_inner();
        if vanished > 0 {
            self.reconcile(Reason::CniExitUnobserved).await?;
        }
        Ok(())
    }
}
