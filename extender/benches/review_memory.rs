//! The webhook's heap per AdmissionReview (issue 39, item 2): the peak bytes allocated while one
//! review is read and answered, for the shapes that cost the most per byte of body, each
//! written up to the webhook's body bound (`MAX_REVIEW_BYTES`), read as the webhook reads it now
//! (`webhook::review`, streamed) and as it read it before (`AdmissionReview<DynamicObject>`,
//! then the object to a JSON tree and to a `Pod`). Run:
//!
//! ```sh
//! cargo bench -p baleen-extender --bench review_memory
//! ```
//!
//! The body itself (which the HTTP layer holds while it is read) is not counted in either
//! column; docs/benchmarks.md has the figures and what they mean for the bound.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use baleen_extender::webhook::{MAX_REVIEW_BYTES, review};

/// The system allocator, counting the bytes held and their peak.
struct Counting;

static HELD: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// A global allocator is an unsafe trait: counting what the heap holds needs one.
#[allow(unsafe_code)]
// SAFETY: every call is passed to the system allocator as it came; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let held = HELD.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(held, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) };
        HELD.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The peak bytes `f` held above what was held before it.
fn peak_of(f: impl FnOnce()) -> usize {
    let before = HELD.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    f();
    PEAK.load(Ordering::Relaxed) - before
}

/// A review of a pod whose spec is `spec_head`, items `item(0)`, `item(1)`, ... to fill the
/// body bound, and `spec_tail`.
fn review_of(spec_head: &str, item: impl Fn(usize) -> String, spec_tail: &str) -> Vec<u8> {
    let head = format!(
        r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"uid":"u","kind":{{"group":"","version":"v1","kind":"Pod"}},"resource":{{"group":"","version":"v1","resource":"pods"}},"requestKind":{{"group":"","version":"v1","kind":"Pod"}},"requestResource":{{"group":"","version":"v1","resource":"pods"}},"namespace":"team-a","operation":"CREATE","userInfo":{{"username":"u"}},"dryRun":false,"object":{{"apiVersion":"v1","kind":"Pod","metadata":{{"name":"p"}},"spec":{{{spec_head}"#
    );
    let tail = format!(r#"{spec_tail}}}}},"oldObject":null}}}}"#);
    let room = MAX_REVIEW_BYTES - head.len() - tail.len();
    let mut items = Vec::new();
    let mut used = 0;
    for i in 0.. {
        let next = item(i);
        if used + next.len() + 1 > room {
            break;
        }
        used += next.len() + 1;
        items.push(next);
    }
    let mut body = head.into_bytes();
    body.extend_from_slice(items.join(",").as_bytes());
    body.extend_from_slice(tail.as_bytes());
    body
}

fn main() {
    let domain = "awesome-ai-company.com";
    let shapes: Vec<(&str, Vec<u8>)> = vec![
        (
            "one container whose args are [0] items (the attack)",
            review_of(r#""containers":[{"name":"c","args":["#, |_| "[0]".into(), "]}]"),
        ),
        ("empty containers {}", review_of(r#""containers":["#, |_| "{}".into(), "]")),
        (
            "containers with one gpu-memory limit each",
            review_of(
                r#""containers":["#,
                |_| r#"{"resources":{"limits":{"awesome-ai-company.com/gpu-memory":1}}}"#.into(),
                "]",
            ),
        ),
        (
            "one container, limits of many distinct baleen names",
            review_of(
                r#""containers":[{"name":"c","resources":{"limits":{"awesome-ai-company.com/gpu-memory":"1","#,
                |i| format!(r#""awesome-ai-company.com/{i}":0"#),
                "}}}]",
            ),
        ),
        (
            "tolerations of empty objects (a field not read)",
            review_of(r#""tolerations":["#, |_| "{}".into(), "]"),
        ),
        (
            "one container whose name is escapes (kept, unescaped)",
            review_of(r#""containers":[{"name":""#, |_| r"\u0041".into(), r#""}]"#),
        ),
    ];
    println!("| body | bytes | before: peak heap | now: peak heap | ratio |");
    println!("|---|---|---|---|---|");
    let mut worst = 0;
    for (what, body) in &shapes {
        let rule = review::Rule {
            domain,
            scheduler: "baleen-scheduler",
            largest_units: Some(140),
            cpu_only: false,
            claims: None,
        };
        let now = peak_of(|| {
            let reviewed = review::read(body, rule).expect("a review");
            assert!(reviewed.verdict.is_ok(), "{what}: {:?}", reviewed.verdict);
            std::hint::black_box(review::answer(&reviewed, "baleen-scheduler"));
        });
        let before = peak_of(|| {
            // What the webhook did before: a dynamic review, its object a tree and then a Pod.
            let review: kube::core::admission::AdmissionReview<kube::core::DynamicObject> =
                serde_json::from_slice(body).expect("a review");
            let request: kube::core::admission::AdmissionRequest<kube::core::DynamicObject> =
                review.try_into().expect("a request");
            let tree =
                serde_json::to_value(request.object.as_ref().expect("an object")).expect("a tree");
            let pod = serde_json::from_value::<baleen_extender::protocol::Pod>(tree);
            std::hint::black_box(&pod);
            std::hint::black_box(&request);
        });
        worst = worst.max(now);
        println!(
            "| {what} | {} | {:.1} MiB | {:.3} MiB | {:.0}x |",
            body.len(),
            before as f64 / f64::from(1 << 20),
            now as f64 / f64::from(1 << 20),
            before as f64 / now.max(1) as f64
        );
    }
    println!(
        "worst now: {:.3} MiB a review beside its body ({} reviews at once: {:.1} MiB with their bodies)",
        worst as f64 / f64::from(1 << 20),
        baleen_extender::webhook::MAX_CONCURRENT_REVIEWS,
        (baleen_extender::webhook::MAX_CONCURRENT_REVIEWS * (worst + MAX_REVIEW_BYTES)) as f64
            / f64::from(1 << 20)
    );
}
