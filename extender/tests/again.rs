//! A filter answer given again (issue 25, item 1): kube-scheduler sends the same names pod after
//! pod, so the extender keeps its latest answer per names and demand and gives it again where
//! no node among the names changed its verdict since, judging only the nodes the view's change
//! log names; the answers of the other demands are judged ahead, and the scores made ahead for
//! `prioritize` are patched from the answer made before for the same nodes. Held here to the
//! answers judged and scored afresh, byte for byte, through any sequence of node changes,
//! removals, returns, bound and deleted pods, demands and policy rebuilds.

use baleen_extender::cluster::{NodeEntry, PodEntry};
use baleen_extender::protocol::{ExtenderArgs, Node, Pod};
use baleen_extender::service::{Extender, FilterHow, Settings};
use proptest::prelude::*;
use serde_json::{Value, json};

const KEY: &str = "awesome-ai-company.com/gpu-state";
const DOMAIN: &str = "awesome-ai-company.com";
const NODES: usize = 12;
const FREE: [u32; 5] = [0, 20, 60, 100, 140];

fn node(name: &str, free: &[u32]) -> Node {
    let state = baleen_k8s::fixtures::h200_state(name, free);
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {KEY: state.to_json()}},
        "status": {"allocatable": {"cpu": "96", "memory": "1000Gi"},
                   "capacity": {format!("{DOMAIN}/gpu-memory"): (free.len() * 140).to_string()}}
    }))
    .expect("node")
}

fn pod(uid: &str, units: u32, on: Option<&str>) -> Value {
    json!({"metadata": {"name": uid, "namespace": "ns", "uid": uid},
           "spec": {"nodeName": on, "containers": [{"name": "c", "resources": {
               "limits": {format!("{DOMAIN}/gpu-memory"): units},
               "requests": {"cpu": "1", "memory": "1Gi"}}}]}})
}

/// One step of the cluster between two filter calls.
#[derive(Debug, Clone)]
enum Step {
    /// Node `.0`'s document changes to these free units per GPU.
    Set(usize, [u32; 2]),
    /// Node `.0` goes away (a name then unknown to the view's entries).
    Remove(usize),
    /// A pod asking `.1` units is bound to node `.0` (counted where the document does not
    /// show it yet).
    Bind(usize, u32),
    /// The `.0`-th pod bound so far is deleted.
    Delete(usize),
    /// Many changes at once, more than the change log keeps.
    Flood,
    /// Nothing changes.
    Still,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..NODES, 0..5usize, 0..5usize).prop_map(|(n, a, b)| Step::Set(n, [FREE[a], FREE[b]])),
        1 => (0..NODES).prop_map(Step::Remove),
        3 => (0..NODES, prop::sample::select(vec![8u32, 20, 40, 70])).prop_map(|(n, u)| Step::Bind(n, u)),
        1 => (0..8usize).prop_map(Step::Delete),
        1 => Just(Step::Flood),
        4 => Just(Step::Still),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Whatever happens between calls, the answer given is the answer judged afresh.
    #[test]
    fn an_answer_given_again_is_the_answer_judged_afresh(
        steps in proptest::collection::vec(
            (step(), prop::sample::select(vec![8u32, 40, 100, 140]), 0..3u8),
            1..60,
        ),
        spaced in proptest::bool::weighted(0.25),
    ) {
        let (extender, names) = cluster();
        // The names as kube-scheduler sends them, one repeated.
        let mut sent = names.clone();
        sent.push(names[3].clone());
        let mut bound: Vec<String> = Vec::new();
        let mut hows = Vec::new();
        // The other answers kept, judged ahead (as the server does beside the calls) right
        // after a call, after the next changes, or never.
        let mut pending = None;
        for (k, (step, units, judge_when)) in steps.iter().enumerate() {
            apply(&extender, &names, &mut bound, k, step);
            if let Some(judge) = pending.take() {
                extender.judge_ahead(&judge);
            }
            // Compact as kube-scheduler writes it, or with spaces (then never patched).
            let array = if spaced {
                serde_json::to_string_pretty(&sent).expect("json")
            } else {
                serde_json::to_string(&sent).expect("json")
            };
            let body = format!(
                r#"{{"Pod":{},"Nodes":null,"NodeNames":{array}}}"#,
                pod(&format!("p{k}"), *units, None)
            );
            let args = ExtenderArgs::parse(body.as_bytes()).expect("args");
            let afresh = extender.filter_json(&args);
            let given = extender.filter_call(body.as_bytes()).expect("answered");
            prop_assert_eq!(
                String::from_utf8_lossy(&given.body),
                String::from_utf8_lossy(&afresh.body),
                "step {} ({:?}), {} units", k, step, units
            );
            prop_assert_eq!(given.removed, afresh.removed);
            if matches!(step, Step::Flood) && k > 0 {
                prop_assert_eq!(given.how, FilterHow::Reused, "past the change log, judged afresh");
            }
            if spaced {
                prop_assert!(given.how != FilterHow::Patched);
            }
            hows.push(given.how);
            match (judge_when, given.judge) {
                (1, Some(judge)) => extender.judge_ahead(&judge),
                (2, judge) => pending = judge,
                _ => {}
            }
        }
        prop_assert_eq!(hows[0], FilterHow::Read);
    }
}

/// An extender whose cache holds the nodes `n0` to `n11`, two GPUs each, and their names.
fn cluster() -> (std::sync::Arc<Extender>, Vec<String>) {
    let extender = Extender::new(Settings::default());
    let names: Vec<String> = (0..NODES).map(|i| format!("n{i}")).collect();
    {
        let mut view = extender.cluster.write().expect("lock");
        for (i, name) in names.iter().enumerate() {
            view.set_node(name, NodeEntry::of(&node(name, &[FREE[i % 5], FREE[(i + 2) % 5]]), KEY));
        }
    }
    (extender, names)
}

/// Applies `step` to the view (bound pods' UIDs kept in `bound`).
fn apply(extender: &Extender, names: &[String], bound: &mut Vec<String>, k: usize, step: &Step) {
    let mut view = extender.cluster.write().expect("lock");
    match step {
        Step::Set(n, free) => {
            view.set_node(&names[*n], NodeEntry::of(&node(&names[*n], free), KEY))
        }
        Step::Remove(n) => view.remove_node(&names[*n]),
        Step::Bind(n, u) => {
            let uid = format!("b{k}");
            let p: Pod = serde_json::from_value(pod(&uid, *u, Some(&names[*n]))).expect("pod");
            view.set_pod(&uid, PodEntry::of(&p, DOMAIN));
            bound.push(uid);
        }
        Step::Delete(i) => {
            if !bound.is_empty() {
                let uid = bound.remove(i % bound.len());
                view.remove_pod(&uid);
            }
        }
        Step::Flood => {
            for j in 0..1100 {
                let n = j % NODES;
                view.set_node(&names[n], NodeEntry::of(&node(&names[n], &[FREE[j % 5], 140]), KEY));
            }
        }
        Step::Still => {}
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// kube-scheduler's filter then prioritize with the names the filter passed, whatever
    /// happens between pods (and, now and then, between the two calls, or a policy rebuild):
    /// the scores answered (made ahead, patched from the answer made before for the same
    /// nodes, or computed) are the scores computed afresh, byte for byte.
    #[test]
    fn scores_made_ahead_or_patched_are_the_scores_computed_afresh(
        steps in proptest::collection::vec(
            (step(), prop::sample::select(vec![8u32, 20, 40, 100]), 0..10u8),
            1..60,
        ),
    ) {
        use baleen_extender::service::Prioritized;
        let (extender, names) = cluster();
        let mut bound: Vec<String> = Vec::new();
        for (k, (step, units, when)) in steps.iter().enumerate() {
            // 0: the policy rebuilt before the pod; 1: the step lands between filter and
            // prioritize; else before the filter.
            if *when == 0 {
                extender.rebuild_policy();
            }
            if *when != 1 {
                apply(&extender, &names, &mut bound, k, step);
            }
            let p = pod(&format!("p{k}"), *units, None);
            let body = json!({"Pod": p, "Nodes": null, "NodeNames": names}).to_string();
            let filtered = extender.filter_call(body.as_bytes()).expect("answered");
            if let Some(ahead) = &filtered.ahead {
                extender.prepare_ahead(ahead);
            }
            if let Some(judge) = &filtered.judge {
                extender.judge_ahead(judge);
            }
            if *when == 1 {
                apply(&extender, &names, &mut bound, k, step);
            }
            let passed: Value = serde_json::from_slice(&filtered.body).expect("json");
            let body = serde_json::to_string(
                &json!({"Pod": p, "Nodes": null, "NodeNames": passed["NodeNames"]}),
            )
            .expect("json");
            let given = match extender.prioritize_call(body.as_bytes()).expect("answered") {
                Prioritized::Ahead(b) => b.to_vec(),
                Prioritized::Computed(b) => b,
            };
            let args = ExtenderArgs::parse(body.as_bytes()).expect("args");
            let afresh = extender.prioritize_json(&args).expect("scores");
            prop_assert_eq!(
                String::from_utf8_lossy(&given),
                String::from_utf8_lossy(&afresh),
                "pod {} ({:?}, {} units, when {})", k, step, units, when
            );
        }
    }
}

/// The three ways an answer is made ahead are all taken by a run of pods of one demand while
/// single nodes change between them: the answer kept (nothing of its nodes changed), patched
/// (a node changed that held neither the least nor the greatest raw score alone), afresh (the
/// first, and after a change that moved those).
#[test]
fn scores_are_made_kept_patched_and_afresh() {
    let extender = Extender::new(Settings::default());
    let names: Vec<String> = (0..40).map(|i| format!("n{i}")).collect();
    let set = |n: usize, free: &[u32]| {
        extender
            .cluster
            .write()
            .expect("lock")
            .set_node(&names[n], NodeEntry::of(&node(&names[n], free), KEY));
    };
    for n in 0..names.len() {
        set(n, &[FREE[n % 5], FREE[(n / 5) % 5]]);
    }
    let call = || {
        let body =
            json!({"Pod": pod("p", 20, None), "Nodes": null, "NodeNames": names}).to_string();
        let filtered = extender.filter_call(body.as_bytes()).expect("answered");
        extender.prepare_ahead(&filtered.ahead.expect("many nodes pass"));
    };
    let made = |how: &str| extender.scores_made.with_label_values(&[how]).get();
    call();
    assert_eq!(made("afresh"), 1);
    call();
    assert_eq!(made("kept"), 1, "nothing changed");
    for k in 0..30 {
        set(k % names.len(), &[FREE[(k * 3) % 5], FREE[(k * 7 + 1) % 5]]);
        call();
    }
    assert!(made("patched") > 0, "kept {} afresh {}", made("kept"), made("afresh"));
    assert!(made("afresh") > 1, "patched {}", made("patched"));
}

/// The answer is given again where nothing among the names changed its verdict, patched where
/// a node's did, judged afresh past the change log: the paths the property above compares are
/// all taken.
#[test]
fn both_paths_are_taken() {
    let extender = Extender::new(Settings::default());
    let names: Vec<String> = (0..NODES).map(|i| format!("n{i}")).collect();
    let set = |n: usize, free: &[u32]| {
        extender
            .cluster
            .write()
            .expect("lock")
            .set_node(&names[n], NodeEntry::of(&node(&names[n], free), KEY));
    };
    for n in 0..NODES {
        set(n, &[140, 20]);
    }
    let call = |units: u32| {
        let body =
            json!({"Pod": pod("p", units, None), "Nodes": null, "NodeNames": names}).to_string();
        extender.filter_call(body.as_bytes()).expect("answered")
    };
    assert_eq!(call(40).how, FilterHow::Read);
    assert_eq!(call(40).how, FilterHow::Again, "nothing changed");
    // n1 still fits 40 units: the same answer.
    set(1, &[100, 20]);
    assert_eq!(call(40).how, FilterHow::Again, "n1 changed but still fits");
    // n2 no longer fits: the answer patched, and it is out.
    set(2, &[20, 20]);
    let answer = call(40);
    assert_eq!(answer.how, FilterHow::Patched);
    let answer: Value = serde_json::from_slice(&answer.body).expect("json");
    assert!(answer["FailedNodes"]["n2"].is_string(), "{answer}");
    assert_eq!(call(40).how, FilterHow::Again, "the patched answer is the latest");
    // Another demand has its own answer.
    assert_eq!(call(8).how, FilterHow::Reused);
    assert_eq!(call(8).how, FilterHow::Again);
    // n2 back, n5 and n7 out: one patch, three verdicts.
    set(2, &[140, 20]);
    set(5, &[20, 20]);
    set(7, &[0, 0]);
    let answer = call(40);
    assert_eq!(answer.how, FilterHow::Patched);
    let answer: Value = serde_json::from_slice(&answer.body).expect("json");
    let passed: Vec<&str> =
        answer["NodeNames"].as_array().expect("names").iter().filter_map(Value::as_str).collect();
    assert_eq!(passed, ["n0", "n1", "n2", "n3", "n4", "n6", "n8", "n9", "n10", "n11"]);
    // Judged ahead: after a call for 8 units, the answer kept for 40 is judged again beside
    // it, so the next call for 40 finds it patched and gives it again.
    set(2, &[20, 20]);
    let answer = call(8);
    extender.judge_ahead(&answer.judge.expect("the other demand's answer to judge"));
    let answer = call(40);
    assert_eq!(answer.how, FilterHow::Again, "patched ahead, given again");
    let answer: Value = serde_json::from_slice(&answer.body).expect("json");
    assert!(answer["FailedNodes"]["n2"].is_string(), "{answer}");
    // More changes than the log keeps: judged afresh.
    for _ in 0..1100 {
        set(3, &[140, 20]);
    }
    assert_eq!(call(40).how, FilterHow::Reused);
}

/// Calls of several pods at once while the nodes change under them (kube-scheduler's profiles,
/// a watcher's events), each followed by its judging ahead: whatever answers were kept or
/// patched in between, once the nodes stand
/// still every demand's answer is again the one judged afresh, and every answer given during
/// the run named only the nodes sent, each once.
#[test]
fn answers_kept_through_concurrent_calls_and_changes_are_the_answers_judged_afresh() {
    let extender = Extender::new(Settings::default());
    let names: Vec<String> = (0..NODES).map(|i| format!("n{i}")).collect();
    let set = |n: usize, free: [u32; 2]| {
        extender
            .cluster
            .write()
            .expect("lock")
            .set_node(&names[n], NodeEntry::of(&node(&names[n], &free), KEY));
    };
    for n in 0..NODES {
        set(n, [FREE[n % 5], 140]);
    }
    let body = |units: u32| {
        json!({"Pod": pod("p", units, None), "Nodes": null, "NodeNames": names}).to_string()
    };
    std::thread::scope(|scope| {
        for caller in 0..2u32 {
            let (extender, body, names) = (&extender, &body, &names);
            scope.spawn(move || {
                for k in 0..400u32 {
                    let units = [8, 40, 100, 140][((k + caller) % 4) as usize];
                    let answer = extender.filter_call(body(units).as_bytes()).expect("answered");
                    // The others judged ahead as the server does, beside the other caller.
                    if let Some(judge) = &answer.judge {
                        extender.judge_ahead(judge);
                    }
                    let answer: Value = serde_json::from_slice(&answer.body).expect("json");
                    let mut seen: Vec<&str> = answer["NodeNames"]
                        .as_array()
                        .expect("names")
                        .iter()
                        .filter_map(Value::as_str)
                        .chain(
                            answer["FailedNodes"]
                                .as_object()
                                .expect("failed")
                                .keys()
                                .map(String::as_str),
                        )
                        .chain(
                            answer["FailedAndUnresolvableNodes"]
                                .as_object()
                                .expect("failed")
                                .keys()
                                .map(String::as_str),
                        )
                        .collect();
                    seen.sort_unstable();
                    let mut sent: Vec<&str> = names.iter().map(String::as_str).collect();
                    sent.sort_unstable();
                    assert_eq!(seen, sent, "each node answered once: {answer}");
                }
            });
        }
        let set = &set;
        scope.spawn(move || {
            for k in 0..400usize {
                set(k % NODES, [FREE[k % 5], FREE[(k / 3) % 5]]);
            }
        });
    });
    for units in [8, 40, 100, 140] {
        let text = body(units);
        let afresh = extender.filter_json(&ExtenderArgs::parse(text.as_bytes()).expect("args"));
        let given = extender.filter_call(text.as_bytes()).expect("answered");
        assert_eq!(
            String::from_utf8_lossy(&given.body),
            String::from_utf8_lossy(&afresh.body),
            "{units} units"
        );
    }
}
