//! The node ledger: what one node has, what is allocated on it, and nothing more.
//!
//! Every allocation goes through [`NodeLedger::allocate`], which checks the whole request
//! against what is free and changes nothing when it refuses, so the ledger can never
//! over-commit CPU, memory, a GPU's compute share or its memory units. The agent keeps one
//! ledger per node; the replay tool keeps one per simulated node.

use crate::model::{GpuDemand, GpuSet, MAX_GPUS_PER_NODE, NodeSpec, Request};
use crate::units::{MemMib, MemUnits, MilliCpu, MilliGpu};
use thiserror::Error;

/// Identifies one allocation on a node (a container, a task).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AllocationId(pub u64);

/// What is free on one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuFree {
    /// Free compute share.
    pub milli: MilliGpu,
    /// Free memory units.
    pub memory: MemUnits,
}

/// One recorded allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// The request that was granted.
    pub request: Request,
    /// The GPUs it holds.
    pub gpus: GpuSet,
}

/// Why the ledger refused a change.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum LedgerError {
    /// The node description is unusable.
    #[error("node {node}: {reason}")]
    InvalidNode {
        /// Node name.
        node: String,
        /// What is wrong.
        reason: String,
    },
    /// The allocation id is already recorded.
    #[error("node {node}: allocation {id:?} already exists")]
    DuplicateAllocation {
        /// Node name.
        node: String,
        /// The id.
        id: AllocationId,
    },
    /// No allocation with this id.
    #[error("node {node}: no allocation {id:?}")]
    UnknownAllocation {
        /// Node name.
        node: String,
        /// The id.
        id: AllocationId,
    },
    /// The request does not fit what is free.
    #[error("node {node}: {reason}")]
    DoesNotFit {
        /// Node name.
        node: String,
        /// What is short.
        reason: String,
    },
}

/// One node's capacity and allocations.
#[derive(Clone, Debug)]
pub struct NodeLedger {
    spec: NodeSpec,
    free_cpu: MilliCpu,
    free_memory: MemMib,
    gpus: Vec<GpuFree>,
    /// A persistent map: a clone of the ledger (the agent changes a clone and publishes it) costs
    /// a pointer, not a copy of every allocation.
    allocations: imbl::OrdMap<AllocationId, Allocation>,
}

impl NodeLedger {
    /// An empty ledger for `spec`.
    pub fn new(spec: NodeSpec) -> Result<Self, LedgerError> {
        if spec.gpus.len() > MAX_GPUS_PER_NODE {
            return Err(LedgerError::InvalidNode {
                node: spec.name.clone(),
                reason: format!(
                    "{} GPUs, at most {MAX_GPUS_PER_NODE} are supported",
                    spec.gpus.len()
                ),
            });
        }
        if let Some(bad) =
            spec.gpus.iter().flat_map(|g| &g.nvlink_peers).find(|&&p| p >= spec.gpus.len())
        {
            return Err(LedgerError::InvalidNode {
                node: spec.name.clone(),
                reason: format!("NVLink peer index {bad} is not a GPU of the node"),
            });
        }
        let gpus = spec
            .gpus
            .iter()
            .map(|g| GpuFree { milli: MilliGpu::WHOLE, memory: g.memory_units })
            .collect();
        Ok(Self {
            free_cpu: spec.cpu,
            free_memory: spec.memory,
            gpus,
            allocations: imbl::OrdMap::new(),
            spec,
        })
    }

    /// The node's description.
    pub fn spec(&self) -> &NodeSpec {
        &self.spec
    }

    /// The node name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Free CPU.
    pub fn free_cpu(&self) -> MilliCpu {
        self.free_cpu
    }

    /// Free host memory.
    pub fn free_memory(&self) -> MemMib {
        self.free_memory
    }

    /// What is free on each GPU, in device-index order.
    pub fn gpus(&self) -> &[GpuFree] {
        &self.gpus
    }

    /// Free compute over all GPUs, in milli-GPU.
    pub fn free_milli_total(&self) -> u64 {
        self.gpus.iter().map(|g| u64::from(g.milli.0)).sum()
    }

    /// Whether GPU `index` has nothing allocated.
    pub fn gpu_is_idle(&self, index: usize) -> bool {
        let g = &self.gpus[index];
        g.milli == MilliGpu::WHOLE && g.memory == self.spec.gpus[index].memory_units
    }

    /// Whether no GPU of the node has anything allocated.
    pub fn gpus_idle(&self) -> bool {
        (0..self.gpus.len()).all(|i| self.gpu_is_idle(i))
    }

    /// Whether GPU `index` can serve one GPU's worth of `request`: a shared request when its
    /// model is allowed and it has the compute share and memory units free, a whole-GPU request
    /// only when nothing is allocated on it.
    pub fn gpu_fits(&self, index: usize, request: &Request) -> bool {
        let spec = &self.spec.gpus[index];
        if !request.allows_model(&spec.model) {
            return false;
        }
        let free = self.gpus[index];
        match request.gpu {
            GpuDemand::None => false,
            GpuDemand::Whole { .. } => self.gpu_is_idle(index),
            GpuDemand::Shared { milli, memory } => free.milli >= milli && free.memory >= memory,
        }
    }

    /// The GPUs that can serve one GPU's worth of `request`.
    pub fn fitting_gpus(&self, request: &Request) -> GpuSet {
        let mut set = GpuSet::EMPTY;
        for i in 0..self.gpus.len() {
            if self.gpu_fits(i, request) {
                set.insert(i);
            }
        }
        set
    }

    /// Whether free CPU and memory cover `request`.
    pub fn host_fits(&self, request: &Request) -> bool {
        self.free_cpu >= request.cpu && self.free_memory >= request.memory
    }

    /// Whether `request` fits on the node at all: its CPU and memory, and enough GPUs that can
    /// serve it.
    pub fn fits(&self, request: &Request) -> bool {
        self.host_fits(request)
            && (request.gpu.gpu_count() == 0
                || self.fitting_gpus(request).len() >= request.gpu.gpu_count() as usize)
    }

    /// The recorded allocations.
    pub fn allocations(&self) -> impl Iterator<Item = (&AllocationId, &Allocation)> {
        self.allocations.iter()
    }

    /// Records `request` on the GPUs `gpus`, or changes nothing and says why it cannot.
    pub fn allocate(
        &mut self,
        id: AllocationId,
        request: &Request,
        gpus: GpuSet,
    ) -> Result<(), LedgerError> {
        let short =
            |reason: String| LedgerError::DoesNotFit { node: self.spec.name.clone(), reason };
        if self.allocations.contains_key(&id) {
            return Err(LedgerError::DuplicateAllocation { node: self.spec.name.clone(), id });
        }
        let free_cpu = self
            .free_cpu
            .checked_sub(request.cpu)
            .ok_or_else(|| short(format!("needs {} CPU, {} free", request.cpu, self.free_cpu)))?;
        let free_memory = self.free_memory.checked_sub(request.memory).ok_or_else(|| {
            short(format!("needs {} memory, {} free", request.memory, self.free_memory))
        })?;
        let want = request.gpu.gpu_count() as usize;
        if gpus.len() != want {
            return Err(short(format!("request needs {want} GPUs, {} were chosen", gpus.len())));
        }
        if let Some(i) = gpus.iter().find(|&i| i >= self.gpus.len()) {
            return Err(short(format!("GPU index {i} does not exist")));
        }
        if let Some(i) = gpus.iter().find(|&i| !self.gpu_fits(i, request)) {
            return Err(short(format!(
                "GPU {} ({}) cannot serve {} and {} of GPU memory: {} and {} free",
                i,
                self.spec.gpus[i].model,
                request.gpu.milli_per_gpu(),
                request.gpu.memory_per_gpu(),
                self.gpus[i].milli,
                self.gpus[i].memory
            )));
        }
        for i in gpus.iter() {
            let (milli, memory) = self.share_of(i, request);
            let g = &mut self.gpus[i];
            g.milli = MilliGpu(g.milli.0 - milli.0);
            g.memory = MemUnits(g.memory.0 - memory.0);
        }
        self.free_cpu = free_cpu;
        self.free_memory = free_memory;
        self.allocations.insert(id, Allocation { request: request.clone(), gpus });
        Ok(())
    }

    /// What `request` takes of GPU `index` when granted it: a whole GPU takes all its memory.
    fn share_of(&self, index: usize, request: &Request) -> (MilliGpu, MemUnits) {
        match request.gpu {
            GpuDemand::Whole { .. } => (MilliGpu::WHOLE, self.spec.gpus[index].memory_units),
            _ => (request.gpu.milli_per_gpu(), request.gpu.memory_per_gpu()),
        }
    }

    /// Releases an allocation and returns it.
    pub fn release(&mut self, id: AllocationId) -> Result<Allocation, LedgerError> {
        let alloc = self
            .allocations
            .remove(&id)
            .ok_or_else(|| LedgerError::UnknownAllocation { node: self.spec.name.clone(), id })?;
        for i in alloc.gpus.iter() {
            let (milli, memory) = self.share_of(i, &alloc.request);
            let g = &mut self.gpus[i];
            g.milli = MilliGpu(g.milli.0 + milli.0);
            g.memory = MemUnits(g.memory.0 + memory.0);
        }
        self.free_cpu = MilliCpu(self.free_cpu.0 + alloc.request.cpu.0);
        self.free_memory = MemMib(self.free_memory.0 + alloc.request.memory.0);
        Ok(alloc)
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation, reason = "test data: a few GPUs")]
mod tests {
    use super::*;
    use crate::model::{GpuModel, GpuSpec};
    use proptest::prelude::*;

    fn spec(gpus: usize, units: u32) -> NodeSpec {
        let model = GpuModel::new("H200");
        NodeSpec {
            name: "node-a".into(),
            cpu: MilliCpu(16_000),
            memory: MemMib(64_000),
            gpus: (0..gpus)
                .map(|i| GpuSpec {
                    memory_units: MemUnits(units),
                    ..GpuSpec::plain(format!("GPU-{i}"), model.clone())
                })
                .collect(),
        }
    }

    fn shared(milli: u32, units: u32) -> Request {
        Request {
            cpu: MilliCpu(1000),
            memory: MemMib(1000),
            gpu: GpuDemand::Shared { milli: MilliGpu(milli), memory: MemUnits(units) },
            allowed_models: vec![],
        }
    }

    fn whole(count: u32) -> Request {
        Request {
            cpu: MilliCpu(1000),
            memory: MemMib(1000),
            gpu: GpuDemand::Whole { count },
            allowed_models: vec![],
        }
    }

    fn set(indices: &[usize]) -> GpuSet {
        GpuSet::from_indices(indices.iter().copied()).expect("small indices")
    }

    #[test]
    fn allocate_and_release_restore_everything() {
        let mut l = NodeLedger::new(spec(2, 80)).expect("valid");
        l.allocate(AllocationId(1), &shared(250, 20), set(&[1])).expect("fits");
        assert_eq!(l.gpus()[1], GpuFree { milli: MilliGpu(750), memory: MemUnits(60) });
        assert_eq!(l.free_cpu(), MilliCpu(15_000));
        l.allocate(AllocationId(2), &whole(1), set(&[0])).expect("fits");
        assert_eq!(l.gpus()[0], GpuFree { milli: MilliGpu(0), memory: MemUnits(0) });
        l.release(AllocationId(1)).expect("known");
        l.release(AllocationId(2)).expect("known");
        assert!(l.gpus_idle());
        assert_eq!((l.free_cpu(), l.free_memory()), (MilliCpu(16_000), MemMib(64_000)));
    }

    #[test]
    fn refusals_name_the_problem_and_change_nothing() {
        let mut l = NodeLedger::new(spec(2, 80)).expect("valid");
        l.allocate(AllocationId(1), &shared(500, 10), set(&[0])).expect("fits");
        let before = l.clone();
        let cases = [
            (AllocationId(1), shared(100, 1), set(&[1]), "already exists"),
            (AllocationId(2), whole(1), set(&[0]), "GPU 0"),
            (AllocationId(3), shared(600, 1), set(&[0]), "GPU 0"),
            (AllocationId(4), shared(100, 90), set(&[1]), "GPU 1"),
            (AllocationId(5), shared(100, 1), set(&[0, 1]), "needs 1 GPUs, 2 were chosen"),
            (AllocationId(6), shared(100, 1), set(&[7]), "GPU index 7 does not exist"),
            (AllocationId(7), whole(2), set(&[0, 1]), "GPU 0"),
        ];
        for (id, req, gpus, needle) in cases {
            let err = l.allocate(id, &req, gpus).expect_err("must refuse");
            assert!(err.to_string().contains(needle), "{err} should mention {needle}");
            assert!(err.to_string().contains("node-a"), "{err} should name the node");
            assert_eq!(l.gpus(), before.gpus());
            assert_eq!(l.free_cpu(), before.free_cpu());
        }
        let mut big = shared(100, 1);
        big.cpu = MilliCpu(100_000);
        assert!(
            l.allocate(AllocationId(8), &big, set(&[1]))
                .expect_err("short")
                .to_string()
                .contains("CPU")
        );
        assert!(matches!(l.release(AllocationId(9)), Err(LedgerError::UnknownAllocation { .. })));
    }

    #[test]
    fn model_constraint_is_checked() {
        let mut l = NodeLedger::new(spec(1, 80)).expect("valid");
        let mut req = shared(100, 1);
        req.allowed_models = vec![GpuModel::new("T4")];
        assert!(l.allocate(AllocationId(1), &req, set(&[0])).is_err());
    }

    #[test]
    fn bad_nodes_are_refused() {
        let mut s = spec(2, 80);
        s.gpus[0].nvlink_peers = vec![5];
        assert!(
            NodeLedger::new(s).expect_err("bad peer").to_string().contains("NVLink peer index 5")
        );
        assert!(NodeLedger::new(spec(65, 1)).is_err());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Shared { gpu: usize, milli: u32, units: u32, cpu: u64 },
        Whole { gpus: Vec<usize> },
        Release(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..4, 1u32..=1000, 0u32..=40, 0u64..=6000)
                .prop_map(|(gpu, milli, units, cpu)| Op::Shared { gpu, milli, units, cpu }),
            proptest::collection::vec(0usize..5, 1..4).prop_map(|gpus| Op::Whole { gpus }),
            (0u64..40).prop_map(Op::Release),
        ]
    }

    proptest! {
        /// Whatever sequence of allocations and releases is attempted, what is free plus what
        /// the recorded allocations hold is exactly the capacity: nothing is over-committed,
        /// lost or counted twice.
        #[test]
        fn never_over_commits(ops in proptest::collection::vec(op(), 1..60)) {
            let mut l = NodeLedger::new(spec(4, 40)).expect("valid");
            for (n, op) in ops.into_iter().enumerate() {
                let id = AllocationId(n as u64);
                let _ = match op {
                    Op::Shared { gpu, milli, units, cpu } => {
                        let mut r = shared(milli, units);
                        r.cpu = MilliCpu(cpu);
                        l.allocate(id, &r, set(&[gpu])).map(|_| ())
                    }
                    Op::Whole { gpus } => {
                        let mut dedup = gpus.clone();
                        dedup.sort();
                        dedup.dedup();
                        l.allocate(id, &whole(dedup.len() as u32), set(&dedup)).map(|_| ())
                    }
                    Op::Release(k) => l.release(AllocationId(k)).map(|_| ()),
                };
                let mut cpu = l.free_cpu().0;
                let mut milli = vec![0u32; 4];
                let mut units = vec![0u32; 4];
                for (i, g) in l.gpus().iter().enumerate() {
                    milli[i] += g.milli.0;
                    units[i] += g.memory.0;
                }
                for (_, a) in l.allocations() {
                    cpu += a.request.cpu.0;
                    for i in a.gpus.iter() {
                        match a.request.gpu {
                            GpuDemand::Whole { .. } => { milli[i] += 1000; units[i] += 40; }
                            _ => { milli[i] += a.request.gpu.milli_per_gpu().0; units[i] += a.request.gpu.memory_per_gpu().0; }
                        }
                    }
                }
                prop_assert_eq!(cpu, 16_000);
                prop_assert_eq!(milli, vec![1000; 4]);
                prop_assert_eq!(units, vec![40; 4]);
            }
        }
    }
}
