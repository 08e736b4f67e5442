//! What a pod requests of a node's CPU and memory, as kube-scheduler counts it (and the kubelet
//! admits it): the app containers and the sidecars (init containers that keep running,
//! `restartPolicy: Always`) run together and are summed; an ordinary init container runs alone
//! before them, so the pod needs the larger of that sum and its largest init container; the
//! pod's overhead (its RuntimeClass's `spec.overhead`) comes on top.
//!
//! Each front end reads its own pod type into [`ContainerRequests`]; the rule is here alone.

/// What a container is to the pod's accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// An app container.
    App,
    /// An init container that keeps running (`restartPolicy: Always`): counted as an app.
    Sidecar,
    /// An ordinary init container: runs alone, before the apps.
    Init,
}

impl Role {
    /// The role of an init container with this `restartPolicy`.
    pub fn of_init(restart_policy: Option<&str>) -> Self {
        if restart_policy == Some("Always") { Role::Sidecar } else { Role::Init }
    }
}

/// One container's CPU and memory requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContainerRequests {
    /// What it is to the pod.
    pub role: Role,
    /// CPU, millicores.
    pub cpu_milli: u64,
    /// Memory, bytes.
    pub memory_bytes: u64,
}

/// CPU (millicores) and memory (bytes) a pod requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PodRequests {
    /// CPU, millicores.
    pub cpu_milli: u64,
    /// Memory, bytes.
    pub memory_bytes: u64,
}

/// What the pod of `containers`, with `overhead`, requests (see the module documentation).
/// Sums saturate: a pod that asks for more than a `u64` counts as asking for everything.
pub fn pod_requests(containers: &[ContainerRequests], overhead: PodRequests) -> PodRequests {
    let mut running = PodRequests::default();
    let mut init = PodRequests::default();
    for c in containers {
        match c.role {
            Role::App | Role::Sidecar => {
                running.cpu_milli = running.cpu_milli.saturating_add(c.cpu_milli);
                running.memory_bytes = running.memory_bytes.saturating_add(c.memory_bytes);
            }
            Role::Init => {
                init.cpu_milli = init.cpu_milli.max(c.cpu_milli);
                init.memory_bytes = init.memory_bytes.max(c.memory_bytes);
            }
        }
    }
    PodRequests {
        cpu_milli: running.cpu_milli.max(init.cpu_milli).saturating_add(overhead.cpu_milli),
        memory_bytes: running
            .memory_bytes
            .max(init.memory_bytes)
            .saturating_add(overhead.memory_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(role: Role, cpu_milli: u64, memory_bytes: u64) -> ContainerRequests {
        ContainerRequests { role, cpu_milli, memory_bytes }
    }

    #[test]
    fn apps_and_sidecars_sum_init_containers_run_alone_and_overhead_adds() {
        let none = PodRequests::default();
        let pod = [c(Role::App, 1500, 2 << 30), c(Role::App, 1000, 1 << 30)];
        assert_eq!(
            pod_requests(&pod, none),
            PodRequests { cpu_milli: 2500, memory_bytes: 3 << 30 }
        );
        // An init container larger in CPU, smaller in memory: each resource on its own.
        let with_init = [pod[0], pod[1], c(Role::Init, 4000, 1 << 30)];
        assert_eq!(
            pod_requests(&with_init, none),
            PodRequests { cpu_milli: 4000, memory_bytes: 3 << 30 }
        );
        // A sidecar runs with the apps.
        let with_sidecar = [pod[0], pod[1], c(Role::Sidecar, 500, 1 << 30)];
        assert_eq!(
            pod_requests(&with_sidecar, none),
            PodRequests { cpu_milli: 3000, memory_bytes: 4 << 30 }
        );
        // The RuntimeClass's overhead on top.
        let overhead = PodRequests { cpu_milli: 250, memory_bytes: 1 << 30 };
        assert_eq!(
            pod_requests(&with_init, overhead),
            PodRequests { cpu_milli: 4250, memory_bytes: 4 << 30 }
        );
        assert_eq!(Role::of_init(Some("Always")), Role::Sidecar);
        assert_eq!(Role::of_init(None), Role::Init);
    }
}
