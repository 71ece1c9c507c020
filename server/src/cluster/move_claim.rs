//! Who may act on a recorded move. The map's record of a move names the
//! mover run that holds it (`Moving::claim`) and its phase, and every
//! change of the record is written conditionally on the item it replaces
//! (a CAS through the metadata group's log). A mover acts on the shards
//! only while the record names it, and takes the two steps that cannot
//! be undone only after writing their phase under its claim:
//!
//! - before the source's release it writes `Releasing`: from then on any
//!   mover carries the move through, none abandons it;
//! - before undoing anything it writes `Abandoning`: from then on any
//!   mover finishes the undo, none releases.
//!
//! A mover that lost the record (a mover on a new metadata leader resumed
//! it, an operator paused or cancelled it) fails one of these writes, or
//! notices at its next round, and stops without touching the shards. What
//! it had in flight is a copy or a note, which every step tolerates twice
//! or late (docs/elasticity.md, "Who acts on a move").

use dmkv_common::cluster::map::{ClusterMap, EndedMove, MAX_MOVE_HISTORY, MAX_OUTCOME_LEN, MovePhase, Moving};
use dmkv_common::proto::{self, move_step::Kind, move_work::Work};

use super::apply::{encode_move_step, encode_placement};
use super::node::{ClusterError, ClusterNode};
use super::placement::MAX_VERSION;

/// Tries of a write of the record whose outcome was unknown or whose
/// group was busy (each read back first).
const RECORD_TRIES: u32 = 20;
/// Tries of one undo step (as the mover's other steps: 5 s).
const UNDO_TRIES: u32 = 50;
/// Tries of the undo's burn, which must apply (60 s, as a cut-over's step).
const BURN_TRIES: u32 = 600;

/// The map as this mover last wrote it, and the version of the item the
/// group stores it under: the next write is conditional on it.
pub(super) struct Held {
    pub map: ClusterMap,
    pub stored: u64,
}

impl Held {
    pub fn moving(&self) -> Moving {
        self.map.moving.expect("a held map records its move")
    }
}

/// The claim of a mover run whose record write replaces the item stored
/// at version `stored`: above every claim written before (each was at
/// most the version of the write that made it, and versions only grow),
/// so shards can tell a newer mover from a stale one by order. Two that
/// read the same `stored` cannot both write their record.
pub(super) fn claim_after(stored: u64) -> u64 {
    stored + 1
}

/// A mover run's id, beside its claim (see `Moving::run`).
pub(super) fn new_run() -> u64 {
    rand::random::<u64>() | 1
}

/// Why a mover stopped without acting: the record is no longer its own.
pub(super) fn lost(now: Option<&Moving>) -> ClusterError {
    let why = match now {
        None => "the move ended meanwhile".to_string(),
        Some(m) => {
            format!("the move is {} under another claim (paused, cancelled or resumed elsewhere)", m.phase.name())
        }
    };
    ClusterError::Failed(format!("this mover stopped: {why}"))
}

/// Whether `e` says a mover lost its record (see [`lost`]).
pub(super) fn is_lost(e: &ClusterError) -> bool {
    matches!(e, ClusterError::Failed(s) if s.starts_with("this mover stopped"))
}

impl ClusterNode {
    /// Writes `next` as the map if the group still holds `held`'s: the
    /// record is this mover's. An unknown outcome is read back (the write
    /// may have applied) and asked again while the group is between
    /// leaders; a record changed by someone else is [`lost`].
    pub(super) async fn rewrite(&self, held: &mut Held, next: ClusterMap) -> Result<(), ClusterError> {
        let mut last = ClusterError::Busy;
        for _ in 0..RECORD_TRIES {
            match self.meta_write(held.stored, &next).await {
                Ok(stored) => {
                    // This node serves the record as written (others take
                    // it at their next ask of the group).
                    self.adopt_map(next.clone());
                    *held = Held { map: next, stored };
                    return Ok(());
                }
                Err(ClusterError::Store(_)) => {
                    // Refused as changed: by our own earlier try, or by
                    // someone else.
                    let (now, stored) = self.meta_map().await?;
                    if now == next {
                        *held = Held { map: now, stored };
                        return Ok(());
                    }
                    return Err(lost(now.moving.as_ref()));
                }
                Err(e @ (ClusterError::Busy | ClusterError::Uncertain)) => last = e,
                Err(e) => return Err(e),
            }
            if let Ok((now, stored)) = self.meta_map().await {
                if now == next {
                    *held = Held { map: now, stored };
                    return Ok(());
                }
                if stored != held.stored {
                    return Err(lost(now.moving.as_ref()));
                }
            }
            tokio::time::sleep(super::moving::STEP_PAUSE).await;
        }
        Err(last)
    }

    /// Writes the record's phase (this mover's claim kept).
    pub(super) async fn set_phase(&self, held: &mut Held, phase: MovePhase) -> Result<(), ClusterError> {
        let mut next = held.map.clone();
        next.moving.as_mut().expect("a held map records its move").phase = phase;
        self.rewrite(held, next).await
    }

    /// Fails with [`lost`] unless the group's record still is `held`'s.
    /// A record that cannot be read (the group between leaders, this node
    /// deposed) stops the mover too, without undoing anything: the node
    /// leading the group carries the move on (`move_resume.rs`).
    pub(super) async fn check_held(&self, held: &Held) -> Result<(), ClusterError> {
        let (now, stored) = self.meta_map().await.map_err(|e| {
            ClusterError::Failed(format!("this mover stopped: the move's record could not be read ({e:?})"))
        })?;
        if stored != held.stored || now.moving != held.map.moving {
            return Err(lost(now.moving.as_ref()));
        }
        Ok(())
    }

    /// Undoes a move whose record says `Abandoning` under this mover's
    /// claim: the target drops what it took, both shards forget the move,
    /// and the map drops its record (at the version the move would have
    /// flipped to, so every node takes the change) and keeps `outcome` in
    /// its history. A failed step is logged and the undo goes on: what it
    /// leaves is items no one serves (a later move of the partition to
    /// the same shard drops them first) or a record the shard forgets
    /// with its next move of the partition.
    pub(super) async fn undo(&self, held: &mut Held, outcome: String, total_ms: u64) -> Result<(), ClusterError> {
        let m = held.moving();
        debug_assert_eq!(m.phase, MovePhase::Abandoning);
        // Both shards burn the move's version first (a placement change
        // at it that changes no partition): a stale mover's step, own or
        // release of that version that comes after is refused or changes
        // nothing, so no record outlives the undo and the partition stays.
        // It must apply: without it the undo stops here, the record stays
        // abandoning, and the next mover to claim it tries again.
        for shard in [m.from, m.to] {
            let burn = encode_placement(m.version, vec![], vec![], m.claim, crate::clock::now_ms());
            let got = self.step(shard, Work::Propose(burn.into()), BURN_TRIES).await?;
            if got.placement_version < m.version {
                return Err(ClusterError::Failed(format!(
                    "shard {shard} did not burn the move's version {} ({}): the undo is left for the next mover",
                    m.version, got.applied
                )));
            }
        }
        let purge = proto::MovePurge { partition: m.partition, version: m.version, below: MAX_VERSION, claim: m.claim };
        if let Err(e) = self.step(m.to, Work::Purge(purge), UNDO_TRIES).await {
            tracing::warn!(partition = m.partition, shard = m.to, "an abandoned move's copy stays: {e:?}");
        }
        for shard in [m.from, m.to] {
            let forget = encode_move_step(m.partition, m.version, Kind::Forget, m.claim);
            if let Err(e) = self.step(shard, Work::Propose(forget.into()), UNDO_TRIES).await {
                tracing::warn!(partition = m.partition, shard, "the shard keeps the move's record: {e:?}");
            }
        }
        let mut back = held.map.clone();
        back.moving = None;
        back.version = m.version;
        push_history(&mut back, &m, outcome, Default::default(), total_ms);
        self.rewrite(held, back).await
    }

    /// Pauses (`cancel` false) or cancels the move of partition `p`
    /// recorded in the map; this node's replica must lead the group. Only
    /// a move before its cut-over can be: one past it is carried through.
    /// A running mover (here or elsewhere) finds the record no longer its
    /// own at its next round and stops; a paused move goes on when asked
    /// again (`move-partition` with the same target), a cancelled one is
    /// undone here.
    pub async fn control_move(&self, p: u32, cancel: bool) -> Result<proto::MovePartitionReply, ClusterError> {
        let started = std::time::Instant::now();
        let (map, stored) = self.meta_map().await?;
        let Some(m) = map.moving.filter(|m| m.partition == p) else {
            return Err(ClusterError::Failed(match map.moving {
                None => format!("no move is under way (partition {p} is on shard {:?})", map.shard_of_partition(p)),
                Some(m) => format!("partition {p} is not moving; partition {} is", m.partition),
            }));
        };
        let reply = |outcome: &str| proto::MovePartitionReply {
            version: m.version,
            from: m.from,
            outcome: outcome.into(),
            total_ms: started.elapsed().as_millis() as u64,
            ..Default::default()
        };
        match (m.phase, cancel) {
            (MovePhase::Releasing, _) => Err(ClusterError::Failed(format!(
                "the move of partition {p} is past its cut-over (its source may have released it): it is carried \
                 through, not paused or cancelled"
            ))),
            (MovePhase::Paused, false) => Ok(reply("paused already")),
            (MovePhase::Abandoning, false) => {
                Err(ClusterError::Failed(format!("the move of partition {p} is being abandoned")))
            }
            (_, cancel) => {
                // Claimed anew, so whichever mover held it stops.
                let phase = if cancel { MovePhase::Abandoning } else { MovePhase::Paused };
                let mut held = Held { map: map.clone(), stored };
                let mut next = map;
                next.moving = Some(Moving { claim: claim_after(stored), run: new_run(), phase, ..m });
                self.rewrite(&mut held, next).await?;
                let outcome = if cancel { "cancelled" } else { "paused" };
                tracing::info!(partition = p, "the move is {outcome}");
                if cancel {
                    self.undo(&mut held, outcome.into(), started.elapsed().as_millis() as u64).await?;
                }
                Ok(reply(outcome))
            }
        }
    }
}

/// What a move that ended took, for its history entry.
#[derive(Default)]
pub(super) struct Took {
    pub keys: u64,
    pub bytes: u64,
    pub pause_us: u64,
}

/// Adds an ended move to `map`'s history, dropping the oldest past
/// [`MAX_MOVE_HISTORY`].
pub(super) fn push_history(map: &mut ClusterMap, m: &Moving, mut outcome: String, took: Took, total_ms: u64) {
    if outcome.len() > MAX_OUTCOME_LEN {
        let mut cut = MAX_OUTCOME_LEN;
        while !outcome.is_char_boundary(cut) {
            cut -= 1;
        }
        outcome.truncate(cut);
    }
    while map.history.len() >= MAX_MOVE_HISTORY {
        map.history.remove(0);
    }
    map.history.push(EndedMove {
        partition: m.partition,
        from: m.from,
        to: m.to,
        version: m.version,
        outcome,
        keys: took.keys,
        bytes: took.bytes,
        pause_us: took.pause_us,
        total_ms,
        ended_unix_ms: crate::clock::now_ms(),
    });
}
