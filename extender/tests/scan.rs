//! The fast reading of a call's body (`protocol::scan_call`, issue 25) against serde_json's:
//! for any body, the same arguments or the same refusal. kube-scheduler writes compact JSON of
//! plain DNS names; the bodies here also have whitespace, escapes, control characters, keys in
//! any order, twice, unknown, values of the wrong type, text after the object.

use baleen_extender::protocol::{ExtenderArgs, ScannedNames, scan_call};
use proptest::prelude::*;

/// What a parse gave, comparable: the pod, the nodes and the names, or that it failed.
fn outcome(args: Result<ExtenderArgs<'_>, serde_json::Error>) -> Option<String> {
    args.ok().map(|a| {
        let names: Option<Vec<&str>> =
            a.node_names.as_ref().map(|n| n.iter().map(AsRef::as_ref).collect());
        format!("{:?} {:?} {:?}", a.pod, a.nodes, names)
    })
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => "[a-z0-9][a-z0-9.-]{0,20}",
        1 => "[a-z\"\\\\\u{1}\u{7f}ü\u{2028}/ ]{0,6}",
        1 => Just(String::new()),
    ]
}

/// A JSON value for `NodeNames`: names (written by serde_json, so escaped where they must
/// be), `null`, or something that is not a list of names.
fn names_value() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => proptest::collection::vec(name(), 0..8)
            .prop_map(|n| serde_json::to_string(&n).expect("json")),
        1 => Just("null".to_owned()),
        1 => Just("[1, \"a\"]".to_owned()),
        1 => Just("\"a\"".to_owned()),
        1 => Just("[\"a\",]".to_owned()),
        1 => Just("[\"a\\u0062\"]".to_owned()),
        1 => Just("[\"a\tb\"]".to_owned()),
    ]
}

fn pod_value() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => (0u32..200, "[a-z]{1,5}").prop_map(|(units, n)| format!(
            r#"{{"metadata":{{"name":"{n}","namespace":"ns","uid":"u-{n}"}},"spec":{{"containers":[{{"name":"c","resources":{{"limits":{{"awesome-ai-company.com/gpu-memory":{units}}}}}}}]}}}}"#
        )),
        1 => Just("{}".to_owned()),
        1 => Just("null".to_owned()),
        1 => Just("[]".to_owned()),
        1 => Just("{\"metadata\":{\"name\":\"p\\\"q\"}}".to_owned()),
    ]
}

fn space() -> impl Strategy<Value = String> {
    prop_oneof![6 => Just(String::new()), 1 => Just(" ".to_owned()), 1 => Just("\n\t ".to_owned())]
}

/// A body: fields in any order, some twice or missing, unknown ones, whitespace, trailing text.
fn body() -> impl Strategy<Value = String> {
    let field = prop_oneof![
        3 => pod_value().prop_map(|v| ("Pod".to_owned(), v)),
        3 => names_value().prop_map(|v| ("NodeNames".to_owned(), v)),
        1 => Just(("Nodes".to_owned(), "null".to_owned())),
        1 => Just(("Nodes".to_owned(), "{\"items\":[]}".to_owned())),
        1 => Just(("Nodes".to_owned(), "5".to_owned())),
        1 => Just(("Other".to_owned(), "{\"x\":[1,2,{\"y\":null}]}".to_owned())),
        1 => Just(("N\\u006fdeNames".to_owned(), "[\"z\"]".to_owned())),
        1 => Just(("Pod\u{1}".to_owned(), "{}".to_owned())),
    ];
    (
        proptest::collection::vec((field, space(), space()), 0..5),
        space(),
        prop_oneof![8 => Just(String::new()), 1 => Just(" x".to_owned()), 1 => Just("}".to_owned())],
    )
        .prop_map(|(fields, end, trailing)| {
            let inner: Vec<String> = fields
                .into_iter()
                .map(|((k, v), a, b)| format!("{a}\"{k}\"{b}:{a}{v}{b}"))
                .collect();
            format!("{{{}{end}}}{trailing}", inner.join(","))
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// Any body: the fast read and serde_json's agree (the same arguments, or both refuse).
    #[test]
    fn the_fast_read_is_serde_jsons(body in body()) {
        let fast = outcome(ExtenderArgs::parse(body.as_bytes()));
        let serde = outcome(serde_json::from_slice::<ExtenderArgs<'_>>(body.as_bytes()));
        prop_assert_eq!(fast, serde, "{}", body);
        // Names split are handed back with their array's text, exactly that array (the filter
        // keeps it to know the same names in a later call by their bytes).
        if let Some(scanned) = scan_call(body.as_bytes(), &[])
            && let ScannedNames::Split { names, text } = &scanned.names
        {
            let again: Vec<String> = serde_json::from_str(text).expect("the text is an array");
            prop_assert_eq!(&again, names, "{}", body);
            prop_assert!(text.starts_with('[') && text.ends_with(']'), "{}", text);
        }
    }

    /// A body whose names are byte for byte a known array is found as that array, and its
    /// arguments are still serde_json's.
    #[test]
    fn a_known_array_is_found_by_its_bytes(names in proptest::collection::vec(name(), 2..6), pod in pod_value()) {
        let array = serde_json::to_string(&names).expect("json");
        let other = serde_json::to_string(&names[1..]).expect("json");
        let body = format!(r#"{{"Pod":{pod},"Nodes":null,"NodeNames":{array}}}"#);
        let serde = outcome(serde_json::from_slice::<ExtenderArgs<'_>>(body.as_bytes()));
        match scan_call(body.as_bytes(), &[other.as_bytes(), array.as_bytes()]) {
            Some(scanned) => {
                prop_assert!(matches!(scanned.names, ScannedNames::Known(1, t) if t == array));
                prop_assert_eq!(outcome(Ok(scanned.into_args())), serde);
            }
            None => prop_assert_eq!(serde, None, "{}", body),
        }
    }
}

/// What kube-scheduler sends is read the fast way (not handed to serde_json), including
/// 5,000 names.
#[test]
fn kube_schedulers_bodies_are_read_the_fast_way() {
    let names: Vec<String> = (0..5000).map(|i| format!("node-{i:05}.example.internal")).collect();
    let body = serde_json::to_string(&serde_json::json!({
        "Pod": {"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
                "spec": {"containers": [{"name": "c", "resources": {"limits": {"awesome-ai-company.com/gpu-memory": 8}}}]}},
        "Nodes": null,
        "NodeNames": names,
    }))
    .expect("json");
    let scanned = scan_call(body.as_bytes(), &[]).expect("the fast way");
    let ScannedNames::Split { names: split, text } = &scanned.names else {
        panic!("names split: {:?}", scanned.names)
    };
    assert_eq!(split.len(), 5000);
    // The array's text is handed back as it lies in the body (what later calls are compared
    // with).
    assert_eq!(*text, serde_json::to_string(&names).expect("json"));
    assert_eq!(split[4999], "node-04999.example.internal");
    let known = serde_json::to_string(&names).expect("json");
    let scanned = scan_call(body.as_bytes(), &[known.as_bytes()]).expect("the fast way");
    assert!(matches!(scanned.names, ScannedNames::Known(0, _)));
}
