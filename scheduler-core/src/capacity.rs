//! What a node can still give, per GPU, NVLink group and MIG profile, and whether a pod's asks
//! fit it: gpu-memory units all on one GPU, whole GPUs, NVLink groups and MIG instances. The
//! extender builds a [`Capacity`] from a node's published state and asks it for its filter
//! verdict; the agent's ledger asks it whether the MIG instances or NVLink groups a
//! GetPreferredAllocation names can be given, and publishes the state the extender reads; a
//! property test (`tests/tests/e2e/agreement.rs`) holds the two to the same answer.

use std::collections::BTreeMap;

/// One container's ask of GPU resources.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Ask {
    /// `gpu-memory`: units, all on one GPU.
    GpuMemory(u32),
    /// `gpu`: whole GPUs.
    Gpus(u32),
    /// `mig-<profile>`: instances of one profile.
    Mig(String, u32),
    /// `nvlink-group-<size>`: groups of that size.
    NvlinkGroups(u32, u32),
}

impl Ask {
    /// How many devices of its resource it asks.
    pub fn count(&self) -> u64 {
        u64::from(match self {
            Ask::GpuMemory(n) | Ask::Gpus(n) | Ask::Mig(_, n) | Ask::NvlinkGroups(_, n) => *n,
        })
    }
}

/// What one GPU can still give.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuCap {
    /// Free gpu-memory units.
    pub units_free: u32,
    /// Its memory units are offered.
    pub shares: bool,
    /// It can be taken whole.
    pub whole: bool,
    /// Free MIG instances by profile.
    pub mig: BTreeMap<String, u32>,
}

/// One NVLink group of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// Its number of GPUs.
    pub size: u32,
    /// Its GPUs, by index.
    pub gpus: Vec<usize>,
    /// It can be taken now.
    pub free: bool,
}

/// What a node can still give, per GPU, NVLink group and MIG profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capacity {
    gpus: Vec<GpuCap>,
    groups: Vec<Group>,
}

impl Capacity {
    /// A node whose GPUs and groups can give `gpus` and `groups`.
    pub fn new(gpus: Vec<GpuCap>, groups: Vec<Group>) -> Self {
        Self { gpus, groups }
    }

    /// A node whose GPUs can give `gpus` and whose groups are free exactly when each of their
    /// GPUs can be taken whole (a node with nothing allocated).
    pub fn with_groups_of_whole_gpus(gpus: Vec<GpuCap>, groups: &[(u32, Vec<usize>)]) -> Self {
        let groups = groups
            .iter()
            .map(|(size, members)| Group {
                size: *size,
                free: members.iter().all(|&i| gpus.get(i).is_some_and(|g| g.whole)),
                gpus: members.clone(),
            })
            .collect();
        Self { gpus, groups }
    }

    /// Marks GPU `i` as held whole: no units, no group containing it.
    fn hold_whole(&mut self, i: usize) {
        let g = &mut self.gpus[i];
        g.shares = false;
        g.units_free = 0;
        self.not_whole(i);
    }

    /// GPU `i` can no longer be taken whole, nor any group containing it.
    fn not_whole(&mut self, i: usize) {
        self.gpus[i].whole = false;
        for group in &mut self.groups {
            if group.gpus.contains(&i) {
                group.free = false;
            }
        }
    }

    /// Takes what `ask` needs (memory units from the GPU they fit tightest, whole GPUs and
    /// groups lowest index first, MIG instances from the first GPUs that have them), or changes
    /// nothing and says why it cannot.
    pub fn take(&mut self, ask: &Ask) -> Result<(), String> {
        match ask {
            Ask::GpuMemory(n) => {
                let tightest = self
                    .gpus
                    .iter()
                    .enumerate()
                    .filter(|(_, g)| g.shares && g.units_free >= *n)
                    .min_by_key(|(i, g)| (g.units_free, *i))
                    .map(|(i, _)| i);
                let Some(i) = tightest else {
                    let largest = self.gpus.iter().filter(|g| g.shares).map(|g| g.units_free).max();
                    return Err(format!(
                        "no GPU has {n} free gpu-memory units (largest free block: {})",
                        largest.unwrap_or(0)
                    ));
                };
                self.gpus[i].units_free -= n;
                self.not_whole(i);
                Ok(())
            }
            Ask::Gpus(count) => {
                let free: Vec<usize> =
                    (0..self.gpus.len()).filter(|&i| self.gpus[i].whole).collect();
                if free.len() < *count as usize {
                    return Err(format!("{} of {count} whole GPUs free", free.len()));
                }
                for &i in free.iter().take(*count as usize) {
                    self.hold_whole(i);
                }
                Ok(())
            }
            Ask::NvlinkGroups(size, count) => {
                let free: Vec<Vec<usize>> = self
                    .groups
                    .iter()
                    .filter(|g| g.size == *size && g.free)
                    .map(|g| g.gpus.clone())
                    .collect();
                if free.len() < *count as usize {
                    return Err(format!(
                        "{} of {count} NVLink groups of {size} GPUs free",
                        free.len()
                    ));
                }
                for members in free.iter().take(*count as usize) {
                    for &i in members {
                        self.hold_whole(i);
                    }
                }
                Ok(())
            }
            Ask::Mig(profile, count) => {
                let free: u32 = self.gpus.iter().filter_map(|g| g.mig.get(profile)).sum();
                if free < *count {
                    return Err(format!("{free} of {count} MIG {profile} instances free"));
                }
                let mut left = *count;
                for g in &mut self.gpus {
                    if let Some(n) = g.mig.get_mut(profile) {
                        let used = (*n).min(left);
                        *n -= used;
                        left -= used;
                    }
                }
                Ok(())
            }
        }
    }
}

/// `asks` in the order they are placed: whole GPUs and groups first, then MIG, then memory
/// units, largest first (so a fit found is a real one).
pub fn ordered(asks: &[Ask]) -> Vec<&Ask> {
    let mut asks: Vec<&Ask> = asks.iter().collect();
    asks.sort_by_key(|a| match a {
        Ask::NvlinkGroups(size, n) => (0, u64::MAX - u64::from(*size) * u64::from(*n)),
        Ask::Gpus(n) => (1, u64::MAX - u64::from(*n)),
        Ask::Mig(_, n) => (2, u64::MAX - u64::from(*n)),
        Ask::GpuMemory(n) => (3, u64::MAX - u64::from(*n)),
    });
    asks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(units: u32) -> GpuCap {
        GpuCap { units_free: units, shares: true, whole: true, mig: BTreeMap::new() }
    }

    #[test]
    fn units_go_to_the_tightest_gpu_and_take_it_and_its_groups_from_whole_asks() {
        let mut c = Capacity::with_groups_of_whole_gpus(
            vec![plain(10), plain(4), plain(10), plain(10)],
            &[(2, vec![0, 1]), (2, vec![2, 3])],
        );
        c.take(&Ask::GpuMemory(3)).expect("fits GPU 1, the tightest");
        assert_eq!(
            c.take(&Ask::NvlinkGroups(2, 2)),
            Err("1 of 2 NVLink groups of 2 GPUs free".into())
        );
        c.take(&Ask::NvlinkGroups(2, 1)).expect("GPUs 2 and 3");
        assert_eq!(c.take(&Ask::Gpus(1)), Ok(()), "GPU 0");
        assert_eq!(c.take(&Ask::Gpus(1)), Err("0 of 1 whole GPUs free".into()));
        assert_eq!(
            c.take(&Ask::GpuMemory(2)),
            Err("no GPU has 2 free gpu-memory units (largest free block: 1)".into())
        );
    }

    #[test]
    fn mig_instances_are_counted_across_gpus_and_asks_are_placed_largest_whole_first() {
        let mig = |n| GpuCap {
            units_free: 0,
            shares: false,
            whole: false,
            mig: BTreeMap::from([("1g.10gb".to_owned(), n)]),
        };
        let mut c = Capacity::new(vec![mig(1), mig(2)], vec![]);
        c.take(&Ask::Mig("1g.10gb".into(), 3)).expect("three across two GPUs");
        assert_eq!(
            c.take(&Ask::Mig("1g.10gb".into(), 1)),
            Err("0 of 1 MIG 1g.10gb instances free".into())
        );
        let asks =
            [Ask::GpuMemory(1), Ask::Mig("x".into(), 1), Ask::Gpus(1), Ask::NvlinkGroups(2, 1)];
        let kinds: Vec<&Ask> = ordered(&asks);
        assert_eq!(kinds, [&asks[3], &asks[2], &asks[1], &asks[0]]);
    }
}
