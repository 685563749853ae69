//! The launchers' declarations (`crates/kernels/src/launch_sigs.rs`) as C++ `static_assert`s on
//! the kernels' parameter types. `build.rs` compiles them with the kernels (the emulator's
//! build, part of every `cargo test`), so a declaration that disagrees with its kernel, and with
//! it every launch `crates/kernels/src/cuda.rs` makes through that launcher, fails the build
//! where no GPU could run it. `tests/launch_sigs.rs` checks that wrong declarations do fail.

/// One line of `launch_sigs.rs`.
#[derive(Clone, Copy, Debug)]
pub struct Decl {
    /// The launcher's name in `crates/kernels/src/cuda.rs` (`launch::NAME`).
    pub launcher: &'static str,
    /// The kernel's name with `{X}` placeholders.
    pub name: &'static str,
    /// Each placeholder and the instances the kernels define.
    pub domains: &'static [(&'static str, &'static [&'static str])],
    /// `(name, kind, element)`: element "" for the scalar kinds.
    pub params: &'static [(&'static str, &'static str, &'static str)],
}

/// Expands `launch_sigs.rs` into [`DECLS`], the same grammar `cuda.rs` expands into launchers.
macro_rules! cuda_kernels {
    ($( $launcher:ident < $($g:ident),* > $([ $($v:ident),* ])? = $module:ident $name:literal
        $( [ $dom:ident : $($inst:tt)+ ] )*
        ( $( $p:ident : $k:ident $(< $e:ident >)? ),* $(,)? ) ; )*) => {
        /// Every declaration of `launch_sigs.rs`, in its order.
        pub const DECLS: &[Decl] = &[$(
            Decl {
                launcher: stringify!($launcher),
                name: $name,
                domains: &[$( (stringify!($dom), &[$( stringify!($inst) ),+]) ),*],
                params: &[$( (stringify!($p), stringify!($k), concat!("" $(, stringify!($e))?)) ),*],
            }
        ),*];
    };
}

include!("../kernels/src/launch_sigs.rs");

/// The C++ type of an element type of the declarations.
fn c_elem(e: &str) -> Option<&'static str> {
    Some(match e {
        "f32" => "float",
        "bf16" => "bf16_t",
        "u32" => "unsigned int",
        "i64" => "long long",
        "u64" => "unsigned long long",
        _ => return None,
    })
}

/// The C++ parameter type of `kind` (of element `elem`, already instantiated).
fn c_param(kind: &str, elem: &str) -> Result<String, String> {
    let e = || c_elem(elem).ok_or_else(|| format!("unknown element type `{elem}`"));
    Ok(match kind {
        "In" | "Opt" | "Addr" => format!("const {}*", e()?),
        "Out" => format!("{}*", e()?),
        "i64" => "long long".into(),
        "i32" => "int".into(),
        "f32" => "float".into(),
        "AdamWConsts" => "AdamWConsts".into(),
        "FaRows" => "FaRows".into(),
        other => return Err(format!("unknown parameter kind `{other}`")),
    })
}

/// Every instantiation of `d`: its kernel name and C++ parameter types.
///
/// # Errors
///
/// A placeholder of the name or an element without a domain, an unknown kind or element type.
pub fn instances(d: &Decl) -> Result<Vec<(String, Vec<String>)>, String> {
    let mut combos: Vec<Vec<(&str, &str)>> = vec![Vec::new()];
    for (dom, insts) in d.domains {
        combos = combos
            .into_iter()
            .flat_map(|c| {
                insts.iter().map(move |i| {
                    let mut c = c.clone();
                    c.push((*dom, *i));
                    c
                })
            })
            .collect();
    }
    let mut out = Vec::with_capacity(combos.len());
    for combo in combos {
        let mut name = d.name.to_string();
        for (dom, inst) in &combo {
            name = name.replace(&format!("{{{dom}}}"), inst);
        }
        if name.contains('{') {
            return Err(format!(
                "{}: a placeholder of `{}` has no domain",
                d.launcher, d.name
            ));
        }
        let mut params = Vec::with_capacity(d.params.len());
        for (p, kind, elem) in d.params {
            let elem = combo
                .iter()
                .find(|(dom, _)| dom == elem)
                .map_or(*elem, |(_, inst)| *inst);
            params.push(c_param(kind, elem).map_err(|e| format!("{}.{p}: {e}", d.launcher))?);
        }
        out.push((name, params));
    }
    Ok(out)
}

/// The C++ checks of `decls`: one `static_assert` per kernel instantiation that its type is
/// `void (*)(params)` exactly, the message naming the kernel and its launcher.
///
/// # Errors
///
/// As [`instances`].
pub fn cpp(decls: &[Decl]) -> Result<String, String> {
    let mut s = String::from(
        "// Written by crates/kernels-emu/build.rs from crates/kernels/src/launch_sigs.rs.\n\
         #include <type_traits>\n",
    );
    for d in decls {
        for (name, params) in instances(d)? {
            let params = params.join(", ");
            s.push_str(&format!(
                "static_assert(std::is_same<decltype(&{name}), void (*)({params})>::value,\n    \
                 \"{name}: its parameters are not ({params}), as launcher `{}` in \
                 crates/kernels/src/launch_sigs.rs declares\");\n",
                d.launcher
            ));
        }
    }
    Ok(s)
}
