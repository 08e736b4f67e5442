//! Resource quantities with their units, so that a CPU amount can never be added to a GPU share.
//!
//! Every module of the crate speaks these types; parsers convert at the edge.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! quantity {
    ($(#[$doc:meta])* $name:ident, $repr:ty, $unit:literal) => {
        $(#[$doc])*
        #[derive(
            Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub $repr);

        impl $name {
            /// Zero of this quantity.
            pub const ZERO: Self = Self(0);

            /// `self - other`, or `None` when `other` is larger.
            pub fn checked_sub(self, other: Self) -> Option<Self> {
                self.0.checked_sub(other.0).map(Self)
            }

            /// `self + other`, or `None` on overflow.
            pub fn checked_add(self, other: Self) -> Option<Self> {
                self.0.checked_add(other.0).map(Self)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!("{}", $unit), self.0)
            }
        }
    };
}

quantity!(
    /// CPU in thousandths of a core (Kubernetes `m`).
    MilliCpu,
    u64,
    "m"
);
quantity!(
    /// Host memory in MiB.
    MemMib,
    u64,
    "Mi"
);
quantity!(
    /// A share of one GPU's compute in thousandths: 1000 is the whole GPU.
    MilliGpu,
    u32,
    "mgpu"
);
quantity!(
    /// GPU memory in the agent's allocation unit (1 GiB by default).
    MemUnits,
    u32,
    "u"
);

impl MilliGpu {
    /// One whole GPU.
    pub const WHOLE: Self = Self(1000);
}
