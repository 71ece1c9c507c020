//! The mover: moves one partition from its shard to another while
//! clients read and write it (docs/elasticity.md, "The move protocol").
//! It runs on the node whose replica leads the metadata group, which
//! records the move in the map at its plan, and asks the shards' leaders
//! for each step (`moving.rs`).
//!
//! Order, and why: the map records the move (a new version; routing
//! unchanged) and no other change is made until it flips. The source
//! notes the partition's writes from its WATCH entry on, then the target
//! takes a copy from a view of the source and catch-up rounds of the
//! noted keys until a round is small. The cut-over: the source releases
//! the partition at the flip's version (its writes refused, retryable),
//! the last noted keys are copied (none can be written meanwhile), the
//! target owns the partition at that version; only then the map flips.
//! A failure before the cut-over abandons the move (the target drops what
//! it took); from the release on the move is carried to its end.

use std::time::Instant;

use dmkv_common::cluster::map::{ClusterMap, MovePhase, Moving, PARTITIONS, ShardId};
use dmkv_common::proto::{self, move_step::Kind, move_work::Work};

use super::apply::{encode_move_step, encode_placement};
use super::move_claim::{Held, Took, claim_after, is_lost, new_run, push_history};
use super::moving::STEP_PAUSE;
use super::node::{ClusterError, ClusterNode};
use super::placement::MAX_VERSION;

/// Catch-up rounds before the cut-over, at most.
pub const MAX_ROUNDS: u32 = 8;
/// A move's copy rate unless asked otherwise (MiB/s): about a third of
/// what a move took unpaced on a 2-core host with three nodes
/// (docs/elasticity.md, "Measured").
pub const DEFAULT_MOVE_RATE_MIB: u32 = 48;
/// A round that copied at most this many keys is small enough: the next
/// (at the cut-over, with writes refused) copies about as many.
pub const SMALL_ROUND: u64 = 64;
/// Tries of one step whose shard is between leaders or busy (5 s).
pub(super) const STEP_TRIES: u32 = 50;
/// Tries of a step of the cut-over, which must go through (60 s): past it
/// the move is left for the same move asked again.
const CUT_OVER_TRIES: u32 = 600;

impl ClusterNode {
    /// Moves partition `p` to shard `to`; this node's replica must lead
    /// the metadata group. One move at a time per cluster: the map holds
    /// the move under way, and another is refused until it ends; the same
    /// move asked again carries it on from where its shards are (its
    /// mover stopped, or failed after the cut-over began).
    /// The copy before the cut-over sends at most `rate` bytes a second
    /// (0: unpaced), so foreground requests keep their share of the
    /// source's and the target's capacity.
    pub async fn move_partition(
        &self,
        p: u32,
        to: ShardId,
        rate: u64,
    ) -> Result<proto::MovePartitionReply, ClusterError> {
        // One mover per node: a move asked again while its mover still
        // runs here must not run beside it (one of them could abandon what
        // the other carries through).
        struct Running<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Running<'_> {
            fn drop(&mut self) {
                self.0.store(false, std::sync::atomic::Ordering::Release);
            }
        }
        if self.mover_running.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return Err(ClusterError::Failed("a move is running on this node: ask again once it ended".into()));
        }
        let _running = Running(&self.mover_running);
        let started = Instant::now();
        let (map, stored) = self.meta_map().await?;
        if p >= PARTITIONS {
            return Err(ClusterError::Failed(format!("partition {p} does not exist: there are {PARTITIONS}")));
        }
        if to as usize >= map.shards().len() {
            return Err(ClusterError::Failed(format!("shard {to} does not exist: there are {}", map.shards().len())));
        }
        // Above every claim made before: the item version only grows.
        let (claim, run) = (claim_after(stored), new_run());
        let (mut held, resumed) = match map.moving {
            // Asked again (or resumed by the node leading the group): the
            // record is claimed for this mover run, and whoever held it
            // stops at its next round or record write.
            Some(m) if m.partition == p && m.to == to => {
                let phase = if m.phase == MovePhase::Paused { MovePhase::Copying } else { m.phase };
                let mut held = Held { map: map.clone(), stored };
                let mut next = map;
                next.moving = Some(Moving { claim, run, phase, rate_bytes: rate, ..m });
                self.rewrite(&mut held, next).await?;
                (held, true)
            }
            Some(m) => {
                return Err(ClusterError::Failed(format!(
                    "partition {} is moving from shard {} to {} (to map version {}, {}): one move at a time",
                    m.partition,
                    m.from,
                    m.to,
                    m.version,
                    m.phase.name()
                )));
            }
            None => {
                let from = map.shard_of_partition(p).expect("a partition below PARTITIONS");
                if from == to {
                    return Err(ClusterError::Failed(format!("partition {p} is on shard {to} already")));
                }
                // The plan takes version + 1; the flip is version + 2, and
                // nothing else is written in between (the record refuses
                // other moves).
                let version = map.version + 2;
                if version >= MAX_VERSION {
                    return Err(ClusterError::Failed("the map's version is past the bound".into()));
                }
                let mut plan = map.clone();
                plan.version += 1;
                plan.moving = Some(Moving {
                    partition: p,
                    from,
                    to,
                    version,
                    claim,
                    run,
                    phase: MovePhase::Copying,
                    rate_bytes: rate,
                });
                let planned = self.meta_write(stored, &plan).await?;
                (Held { map: plan, stored: planned }, false)
            }
        };
        let m = held.moving();
        let (from, version, rate) = (m.from, m.version, m.rate_bytes);
        debug_assert_eq!(m.claim, claim);
        self.move_book.begin(p, from, to, version, rate);
        let result = async {
            tracing::info!(partition = p, from, to, version, resumed, phase = m.phase.name(), "moving a partition");
            if m.phase == MovePhase::Abandoning {
                // A move another mover began to undo: only the undo is left.
                self.move_book.phase("abandoned");
                let outcome = "abandoned (the undo finished by a later mover)".to_string();
                self.undo(&mut held, outcome, started.elapsed().as_millis() as u64).await?;
                return Err(ClusterError::Failed(format!(
                    "the move of partition {p} had been abandoned: it is undone"
                )));
            }
            // Where a resumed move's shards are: the target owns the
            // partition (only the flip is left), or the source released it
            // or may have (its items are frozen: copied whole again, and the
            // move is carried through), or neither (from the start).
            let (owned, released) = match resumed {
                true => {
                    let owned = self.placement_of(to).await? >= version;
                    let released =
                        owned || m.phase == MovePhase::Releasing || self.placement_of(from).await? >= version;
                    (owned, released)
                }
                false => (false, false),
            };
            let mut copied = Copied { keys: 0, bytes: 0, rounds: 0 };
            let mut pause_us = 0;
            if !owned {
                // Released already (a stopped move resumed): the partition's
                // writes wait for the copy, which goes unpaced.
                let rate = if released { 0 } else { rate };
                copied = match self.copy_phase(&held, rate).await {
                    Ok(c) => c,
                    // Before any release, the move can be undone, once the
                    // record says so under this mover's claim.
                    Err(e) if !released && !is_lost(&e) => {
                        tracing::warn!(partition = p, from, to, "the move is abandoned: {e:?}");
                        self.move_book.phase("abandoned");
                        self.set_phase(&mut held, MovePhase::Abandoning).await?;
                        let outcome = format!("abandoned: {e:?}");
                        self.undo(&mut held, outcome, started.elapsed().as_millis() as u64).await?;
                        return Err(e);
                    }
                    Err(e) => return Err(e),
                };
                // The cut-over: from the release on the move is carried
                // through, by this mover or the next to claim it.
                if m.phase != MovePhase::Releasing {
                    self.set_phase(&mut held, MovePhase::Releasing).await?;
                }
                self.move_book.phase("cut-over");
                let pause = Instant::now();
                let now = crate::clock::now_ms();
                self.placement_step(from, version, encode_placement(version, vec![], vec![p], claim, now)).await?;
                // Unpaced: writes to the partition wait for it.
                // Notes are enough even for a resumed move: a mover taken
                // over takes none once the source recorded this mover's
                // watch (before its first, whole, copy), so none can go
                // missing from what this one copies.
                let mut final_copy = copy(p, to, version, false, 0, claim);
                final_copy.last = true;
                let last = self.copy_round(from, final_copy, CUT_OVER_TRIES).await?;
                self.placement_step(to, version, encode_placement(version, vec![p], vec![], claim, now)).await?;
                pause_us = pause.elapsed().as_micros() as u64;
                copied.keys += last.keys;
                copied.bytes += last.bytes;
                self.move_book.copied(last.keys, last.bytes);
            }
            let mut flipped = held.map.clone();
            flipped.moving = None;
            flipped.move_partition(p, to).map_err(|e| ClusterError::Failed(e.to_string()))?;
            let took = Took { keys: copied.keys, bytes: copied.bytes, pause_us };
            push_history(&mut flipped, &m, "done".into(), took, started.elapsed().as_millis() as u64);
            self.move_book.phase("flip");
            debug_assert_eq!(flipped.version, version);
            self.flip(&mut held, flipped, p, to).await?;
            tracing::info!(partition = p, from, to, version, pause_us, "partition moved");
            self.move_book.phase("clean-up");
            // Clean-up: the source's copy goes, and both forget the move. A
            // failure here leaves items no one serves, and is only logged.
            let purge = proto::MovePurge { partition: p, version, below: MAX_VERSION, claim };
            if let Err(e) = self.step(from, Work::Purge(purge), STEP_TRIES).await {
                tracing::warn!(partition = p, shard = from, "the moved partition's items stay on the source: {e:?}");
            }
            for shard in [from, to] {
                let forget = encode_move_step(p, version, Kind::Forget, claim);
                if let Err(e) = self.step(shard, Work::Propose(forget.into()), STEP_TRIES).await {
                    tracing::warn!(partition = p, shard, "the shard keeps the move's record: {e:?}");
                }
            }
            Ok::<_, ClusterError>(proto::MovePartitionReply {
                version,
                from,
                keys: copied.keys,
                bytes: copied.bytes,
                rounds: copied.rounds,
                pause_us,
                total_ms: started.elapsed().as_millis() as u64,
                outcome: "done".into(),
                ..Default::default()
            })
        }
        .await;
        match &result {
            Ok(r) => self.move_book.end("done".into(), r.pause_us),
            Err(e) if is_lost(e) => self.move_book.end(format!("stopped: {e:?}"), 0),
            Err(e) => self.move_book.end_err(e),
        }
        result
    }

    /// Writes the flipped map, conditionally on the record this mover
    /// holds; after any failure the map is read back (a write whose
    /// outcome was unknown may have applied, and one asked again is then
    /// refused as a changed map). Only the flip's own history entry may
    /// differ in a map read back that flipped (another mover's).
    async fn flip(&self, held: &mut Held, flipped: ClusterMap, p: u32, to: ShardId) -> Result<(), ClusterError> {
        let mut last = ClusterError::Busy;
        for _ in 0..CUT_OVER_TRIES {
            let retry = match self.meta_write(held.stored, &flipped).await {
                Ok(stored) => {
                    self.adopt_map(flipped.clone());
                    *held = Held { map: flipped, stored };
                    return Ok(());
                }
                Err(e) => {
                    let retry = matches!(e, ClusterError::Busy | ClusterError::Uncertain);
                    last = e;
                    retry
                }
            };
            if let Ok((now, _)) = self.meta_map().await
                && now.version >= flipped.version
                && now.shard_of_partition(p) == Some(to)
            {
                self.adopt_map(now);
                return Ok(());
            }
            if !retry {
                break;
            }
            tokio::time::sleep(STEP_PAUSE).await;
        }
        Err(last)
    }

    /// The placement version of `shard` as its leader applied it (a
    /// step that changes nothing: forgetting a move that never was).
    async fn placement_of(&self, shard: ShardId) -> Result<u64, ClusterError> {
        let probe = encode_move_step(0, 0, Kind::Forget, 0);
        Ok(self.step(shard, Work::Propose(probe.into()), CUT_OVER_TRIES).await?.placement_version)
    }

    /// The source watches, the target takes, the whole partition is
    /// copied, then rounds of noted keys until one is small.
    async fn copy_phase(&self, held: &Held, rate: u64) -> Result<Copied, ClusterError> {
        let Moving { partition: p, from, to, version, claim, .. } = held.moving();
        self.check_held(held).await?;
        self.move_step(from, p, version, Kind::Watch, claim).await?;
        self.move_step(to, p, version, Kind::Take, claim).await?;
        let first = self.copy_round(from, copy(p, to, version, true, rate, claim), STEP_TRIES).await?;
        self.move_book.copied(first.keys, first.bytes);
        self.move_book.phase("catch-up");
        let mut copied = Copied { keys: first.keys, bytes: first.bytes, rounds: 0 };
        while copied.rounds < MAX_ROUNDS {
            // Paused, cancelled or resumed by another mover: stop here.
            self.check_held(held).await?;
            let round = self.copy_round(from, copy(p, to, version, false, rate, claim), STEP_TRIES).await?;
            copied.rounds += 1;
            copied.keys += round.keys;
            copied.bytes += round.bytes;
            self.move_book.copied(round.keys, round.bytes);
            if round.keys <= SMALL_ROUND && !round.whole {
                break;
            }
        }
        self.check_held(held).await?;
        Ok(copied)
    }

    /// Records a step of the move on `shard`: the shard must record the
    /// move after it (asked again, it still does).
    async fn move_step(
        &self,
        shard: ShardId,
        p: u32,
        version: u64,
        kind: Kind,
        claim: u64,
    ) -> Result<(), ClusterError> {
        let got = self.step(shard, Work::Propose(encode_move_step(p, version, kind, claim).into()), STEP_TRIES).await?;
        if !got.changed {
            return Err(ClusterError::Failed(format!(
                "shard {shard} refused the move's {kind:?} step ({}): see its log",
                got.applied
            )));
        }
        Ok(())
    }

    /// A placement change at `version` on `shard`: it must apply there
    /// (the shard's placement reaches `version`, which only this move
    /// proposes: the map holds it reserved).
    async fn placement_step(&self, shard: ShardId, version: u64, data: Vec<u8>) -> Result<(), ClusterError> {
        let got = self.step(shard, Work::Propose(data.into()), CUT_OVER_TRIES).await?;
        if got.placement_version != version {
            return Err(ClusterError::Failed(format!(
                "shard {shard}'s placement is at version {}, not the move's {version}: {}",
                got.placement_version, got.applied
            )));
        }
        Ok(())
    }

    /// A copy round, tried again as [`ClusterNode::step`] does; but a round
    /// that failed may have taken the notes it did not copy, so every try
    /// after the first copies the whole partition.
    async fn copy_round(
        &self,
        from: ShardId,
        mut c: proto::MoveCopy,
        tries: u32,
    ) -> Result<proto::MoveWorkReply, ClusterError> {
        let mut last = ClusterError::Busy;
        for _ in 0..tries {
            match self.work_at(from, Work::Copy(c)).await {
                Ok(r) => return Ok(r),
                Err(e @ (ClusterError::NotLeader { .. } | ClusterError::Busy | ClusterError::Uncertain)) => last = e,
                Err(e) => return Err(e),
            }
            c.whole = true;
            // A view aborted (writes outran a paced copy) or a leader lost:
            // the next try holds its view for less long.
            c.rate_bytes = c.rate_bytes.saturating_mul(2);
            tokio::time::sleep(STEP_PAUSE).await;
        }
        Err(last)
    }
}

/// What the copy before the cut-over took.
struct Copied {
    keys: u64,
    bytes: u64,
    rounds: u32,
}

fn copy(partition: u32, to: ShardId, version: u64, whole: bool, rate_bytes: u64, claim: u64) -> proto::MoveCopy {
    proto::MoveCopy { partition, to, version, whole, last: false, rate_bytes, claim }
}
