//! Debian cloud kernels, fetched once with `apt-get download` and cached
//! unpacked under `target/vm/kernels/<series>/`: a second run asks no
//! network. The newest package of a series is taken the first time; delete
//! the series directory to move to a newer one.
//!
//! 6.1 and 6.12 come from the machine's own (bookworm) sources. 5.10 lives
//! only in `bullseye`: it is fetched through a private apt configuration
//! under `target/vm/apt/bullseye/` (its own sources list, lists and cache
//! dirs), so the machine's sources and package lists are never touched.

use std::{
    collections::{HashMap, HashSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use super::{VmError, io_err};
use crate::toolchain::{output, run};

/// The series `--kernel all` boots, oldest first.
pub const SERIES: &[&str] = &["5.10", "6.1", "6.12"];

/// Series that the machine's own sources do not carry: (series, suite).
/// Debian 11 (bullseye) runs 5.10, as Amazon Linux 2 does.
const OTHER_SUITES: &[(&str, &str)] = &[("5.10", "bullseye")];

/// The `apt-get`/`apt-cache` options that point apt at a private
/// configuration for `suite` under `vm_dir`, writing its sources list and
/// creating its dirs on first use. None: the machine's own sources.
fn apt_options(vm_dir: &Path, series: &str) -> Result<Option<Vec<String>>, VmError> {
    let Some((_, suite)) = OTHER_SUITES.iter().find(|(s, _)| *s == series) else { return Ok(None) };
    let dir = vm_dir.join("apt").join(suite);
    let lists = dir.join("lists");
    let cache = dir.join("cache");
    for d in [lists.join("partial"), cache.join("archives").join("partial")] {
        fs::create_dir_all(&d).map_err(io_err(&d))?;
    }
    let sources = dir.join("sources.list");
    let keyring = "/usr/share/keyrings/debian-archive-keyring.gpg";
    let text = format!(
        "deb [signed-by={keyring}] http://deb.debian.org/debian {suite} main\n\
         deb [signed-by={keyring}] http://deb.debian.org/debian-security {suite}-security main\n"
    );
    fs::write(&sources, text).map_err(io_err(&sources))?;
    let empty_parts = dir.join("sources.list.d");
    fs::create_dir_all(&empty_parts).map_err(io_err(&empty_parts))?;
    let opt = |k: &str, v: &Path| format!("-oDir::{k}={}", v.display());
    Ok(Some(vec![
        opt("Etc::sourcelist", &sources),
        opt("Etc::sourceparts", &empty_parts),
        opt("State::Lists", &lists),
        opt("Cache", &cache),
    ]))
}

/// Written last: its presence means the unpacked tree is complete.
const STAMP: &str = "package";

#[derive(Debug, Clone)]
pub struct Kernel {
    pub series: String,
    /// `uname -r`, e.g. `6.1.0-56-cloud-amd64`.
    pub release: String,
    pub package: String,
    pub vmlinuz: PathBuf,
    /// `lib/modules/<release>` of the unpacked package.
    pub modules: PathBuf,
}

/// The kernel of `series`, downloading and unpacking it on first use.
pub fn ensure(vm_dir: &Path, series: &str) -> Result<Kernel, VmError> {
    let dir = vm_dir.join("kernels").join(series);
    let root = dir.join("root");
    if let Ok(package) = fs::read_to_string(dir.join(STAMP)) {
        return locate(series, package.trim(), &root);
    }
    let apt = apt_options(vm_dir, series)?;
    let package = newest_package(series, apt.as_deref())?;
    eprintln!("xtask: vm-test: fetching {package} (once; cached in {})", dir.display());
    let download = dir.join("download");
    let _ = fs::remove_dir_all(&download);
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(&download).map_err(io_err(&download))?;
    run(Command::new("apt-get").current_dir(&download).args(apt.iter().flatten()).args(["download", "-q", &package]))?;
    let deb = fs::read_dir(&download)
        .map_err(io_err(&download))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| VmError::Kernel(format!("apt-get download {package} left no .deb")))?;
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
    let kernel = locate(series, &package, &root)?;
    // Only the unpacked tree is used from now on.
    let _ = fs::remove_dir_all(&download);
    fs::write(dir.join(STAMP), &package).map_err(io_err(&dir.join(STAMP)))?;
    Ok(kernel)
}

/// The highest-versioned `linux-image-<series>.*-cloud-amd64` apt knows,
/// refreshing the package lists once if it knows none.
fn newest_package(series: &str, apt: Option<&[String]>) -> Result<String, VmError> {
    let apt = apt.unwrap_or_default();
    let search = || -> Result<Option<String>, VmError> {
        let pattern = format!("^linux-image-{}\\.", series.replace('.', "\\."));
        let out = output(Command::new("apt-cache").args(apt).args(["search", "--names-only", &pattern]))?;
        Ok(pick_newest(series, &out))
    };
    if let Some(p) = search()? {
        return Ok(p);
    }
    run(Command::new("apt-get").args(apt).args(["update", "-qq"]))?;
    search()?.ok_or_else(|| {
        VmError::Kernel(format!("apt knows no linux-image-{series}.*-cloud-amd64 package (check the Debian sources)"))
    })
}

/// From `apt-cache search` output, the newest signed cloud image of `series`
/// (`-dbg` and `-unsigned` variants excluded; `6.1` never matches `6.12`).
fn pick_newest(series: &str, search_output: &str) -> Option<String> {
    let prefix = format!("linux-image-{series}.");
    search_output
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| name.starts_with(&prefix) && name.ends_with("-cloud-amd64"))
        .max_by_key(|name| version_key(name))
        .map(str::to_owned)
}

/// The numbers of a package name in order: `6.1.0-56-cloud` -> [6, 1, 0, 56].
fn version_key(name: &str) -> Vec<u64> {
    name.split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty()).filter_map(|s| s.parse().ok()).collect()
}

fn locate(series: &str, package: &str, root: &Path) -> Result<Kernel, VmError> {
    let boot = root.join("boot");
    let release = fs::read_dir(&boot)
        .map_err(io_err(&boot))?
        .filter_map(Result::ok)
        .find_map(|e| e.file_name().to_str()?.strip_prefix("vmlinuz-").map(str::to_owned))
        .ok_or_else(|| VmError::Kernel(format!("no vmlinuz-* in {}", boot.display())))?;
    let modules = ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|d| root.join(d).join(&release))
        .find(|p| p.is_dir())
        .ok_or_else(|| VmError::Kernel(format!("no lib/modules/{release} in {}", root.display())))?;
    Ok(Kernel {
        series: series.to_owned(),
        vmlinuz: boot.join(format!("vmlinuz-{release}")),
        release,
        package: package.to_owned(),
        modules,
    })
}

/// A module to insmod in the guest, decompressed.
#[derive(Debug)]
pub struct Module {
    pub name: String,
    pub data: Vec<u8>,
}

/// `wanted` modules and their dependencies, dependencies first; ones built
/// into the kernel are left out. The packages carry no modules.dep (depmod
/// runs at install), so dependencies come from each module's `.modinfo`.
pub fn modules(kernel: &Kernel, wanted: &[&str]) -> Result<Vec<Module>, VmError> {
    let files = module_files(&kernel.modules.join("kernel"))?;
    let builtin = builtin(&kernel.modules);
    let mut out: Vec<Module> = Vec::new();
    for name in wanted {
        add_with_deps(&normalize(name), &files, &builtin, &mut out, &mut Vec::new())?;
    }
    Ok(out)
}

fn add_with_deps(
    name: &str,
    files: &HashMap<String, PathBuf>,
    builtin: &HashSet<String>,
    out: &mut Vec<Module>,
    stack: &mut Vec<String>,
) -> Result<(), VmError> {
    if out.iter().any(|m| m.name == name) || builtin.contains(name) || stack.iter().any(|s| s == name) {
        return Ok(());
    }
    let path =
        files.get(name).ok_or_else(|| VmError::Kernel(format!("module {name} is neither built in nor a .ko")))?;
    let data = decompress(path)?;
    stack.push(name.to_owned());
    for dep in depends(&data) {
        add_with_deps(&dep, files, builtin, out, stack)?;
    }
    stack.pop();
    out.push(Module { name: name.to_owned(), data });
    Ok(())
}

/// Module names use `_` and `-` interchangeably; the kernel says `_`.
fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

/// The module name of a `.ko`, `.ko.xz` or `.ko.zst` path.
fn module_name(path: &Path) -> Option<String> {
    let file = path.file_name()?.to_str()?;
    let stem = file.strip_suffix(".ko").or_else(|| file.split_once(".ko.").map(|(s, _)| s))?;
    Some(normalize(stem))
}

fn module_files(dir: &Path) -> Result<HashMap<String, PathBuf>, VmError> {
    let mut out = HashMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in fs::read_dir(&d).map_err(io_err(&d))?.filter_map(Result::ok) {
            let path = entry.path();
            if path.is_dir() {
                todo.push(path);
            } else if let Some(name) = module_name(&path) {
                out.insert(name, path);
            }
        }
    }
    Ok(out)
}

/// Names in `modules.builtin` (`kernel/net/core/foo.ko` lines).
fn builtin(modules: &Path) -> HashSet<String> {
    fs::read_to_string(modules.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| module_name(Path::new(l.trim())))
        .collect()
}

fn decompress(path: &Path) -> Result<Vec<u8>, VmError> {
    let tool = match path.extension().and_then(|e| e.to_str()) {
        Some("xz") => "xz",
        Some("zst") => "zstd",
        Some("gz") => "gzip",
        _ => return fs::read(path).map_err(io_err(path)),
    };
    let mut cmd = Command::new(tool);
    cmd.arg("-dc").arg(path);
    let out = cmd.output().map_err(|source| VmError::spawn(tool, source))?;
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(VmError::Failed { command: format!("{cmd:?}"), detail: String::from_utf8_lossy(&out.stderr).into() })
    }
}

/// The `depends=a,b` entry of a module's `.modinfo` section.
fn depends(ko: &[u8]) -> Vec<String> {
    let key = b"depends=";
    let Some(at) = ko.windows(key.len()).position(|w| w == key) else { return Vec::new() };
    let rest = &ko[at + key.len()..];
    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    String::from_utf8_lossy(&rest[..end]).split(',').filter(|s| !s.is_empty()).map(normalize).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_image_of_the_series_only() {
        let search = "\
linux-image-6.1.0-9-cloud-amd64 - Linux 6.1 for x86-64 cloud (signed)
linux-image-6.1.0-56-cloud-amd64 - Linux 6.1 for x86-64 cloud (signed)
linux-image-6.1.0-57-cloud-amd64-dbg - Debug symbols
linux-image-6.1.0-57-cloud-amd64-unsigned - Linux 6.1 for x86-64 cloud
linux-image-6.12.117+deb12-cloud-amd64 - Linux 6.12 for x86-64 cloud (signed)
linux-image-6.12.99+deb12-cloud-amd64 - Linux 6.12 for x86-64 cloud (signed)
linux-image-6.12-cloud-amd64 - Linux for x86-64 cloud (meta-package)";
        assert_eq!(pick_newest("6.1", search).as_deref(), Some("linux-image-6.1.0-56-cloud-amd64"));
        assert_eq!(pick_newest("6.12", search).as_deref(), Some("linux-image-6.12.117+deb12-cloud-amd64"));
        assert_eq!(pick_newest("6.6", search), None);
    }

    #[test]
    fn modinfo_depends_and_names() {
        let ko = b"\x7fELF....license=GPL\0depends=stp,llc\0intree=Y\0";
        assert_eq!(depends(ko), ["stp", "llc"]);
        assert!(depends(b"depends=\0").is_empty());
        assert_eq!(module_name(Path::new("kernel/net/bridge/bridge.ko.xz")).as_deref(), Some("bridge"));
        assert_eq!(module_name(Path::new("kernel/drivers/net/veth.ko")).as_deref(), Some("veth"));
        assert_eq!(module_name(Path::new("kernel/x/nf-foo.ko.zst")).as_deref(), Some("nf_foo"));
        assert_eq!(module_name(Path::new("modules.order")), None);
    }
}
