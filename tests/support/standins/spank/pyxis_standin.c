/*
 * A stand-in for NVIDIA's pyxis SPANK plugin (and the part of enroot it drives), for beam-hpc's tests
 * on the local Slurm cluster.
 *
 * Read from: NVIDIA/pyxis 0.24.0 (commit 1075199, args.c and pyxis_slurmstepd.c) and NVIDIA/enroot
 * (commit 8ea147d, conf/mounts/10-system.fstab, src/runtime.sh, conf/hooks/extra/50-slurm-pytorch.sh).
 * What they do that beam-hpc depends on, and what this stand-in does for each:
 *
 *  1. Options (args.c): the names, argument forms and flag values of pyxis's table; malformed values
 *     are refused. Same here (one value per option, mounts SRC:DST[:FLAGS] comma-separated).
 *  2. /tmp is per container (10-system.fstab: "tmpfs /tmp tmpfs x-create=dir,rw,nosuid,nodev,mode=755");
 *     /dev/shm is the host's (a bind in the same file). Here: a task that names an image or a
 *     container gets a private mount namespace (slave of the host's) with a fresh tmpfs on /tmp;
 *     under /tmp it then sees only its --container-mounts and, standing for the image's own files,
 *     the plugstack paths image_files= (the venv, when it lives under /tmp). Everything outside /tmp
 *     is the host's own: there is no image root filesystem, so a mount whose target is outside /tmp
 *     and missing on the host is not made (its entry is listed under "unmounted" in the record).
 *  3. Named containers (pyxis_slurmstepd.c, slurm_spank_user_init): the name is pyxis_<NAME> (scope
 *     global, pyxis's default); unnamed ones are pyxis_<job>.<step>. A name that is RUNNING on the node
 *     (a process is in it: `enroot list -f` shows a PID) is joined: setns into its namespaces
 *     ("reusing existing container namespaces"), and --container-mounts is ignored ("ignoring
 *     --container-mounts when attaching to a running container"). One that exists but runs nothing is
 *     started afresh on its old filesystem: a new /tmp. The flags: create (error if it exists), exec
 *     (error unless it runs), no_exec (never join), auto. Here a container is a mount namespace whose
 *     inode is recorded under record_dir/containers/<node>/; it runs while any process is in that
 *     namespace (a scan of /proc/PID/ns/mnt), and joining is setns(/proc/PID/ns/mnt). Every task of
 *     one step on one node shares one container, as pyxis's first task starts it for the others.
 *  4. Environment (spank_import_container_env): the container's environment (the step's, with the
 *     image's ENV over it: enroot's runtime.sh reads the rootfs's /etc/environment) is imported over
 *     the task's, so the image's values win, except for the names in --container-env; LANG, LANGUAGE
 *     and LC_ALL are dropped unless named there. Here the image's ENV is the NAME=VALUE lines of the
 *     image file (a path; a registry image has none here), or of the joined container's image.
 *  5. PyTorch (pytorch_setup): when PYTORCH_VERSION is in the task's environment after that import
 *     (NGC images set it), RANK=SLURM_PROCID and LOCAL_RANK=SLURM_LOCALID for each task. Same here.
 *     (enroot's optional hook 50-slurm-pytorch.sh also sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE in
 *     the container's environment; not represented: it is a site's choice.)
 *  6. chdir to --container-workdir (else to the container's own directory: here the task's path).
 * Not represented: the image's root filesystem (the task runs the host's programs), user namespaces
 * and root remapping (the tests' jobs run as root, which the mount namespace needs), home hiding
 * (--no-container-mount-home: enroot's 10-home.sh hook), --container-save and --container-unshare.
 *
 * On each node it also writes one JSON file per task saying what the task received and got
 * (record_dir/<job>.<step>.<node>.<task>.json): options, whether it joined a running container, and
 * the values of the variables the image or --container-env touch, as the task will see them.
 *
 * plugstack.conf:  optional /path/pyxis_standin.so record_dir=/some/dir [image_files=/a:/b]
 * Build (CI):      gcc -shared -fPIC -Wall -Werror -o pyxis_standin.so pyxis_standin.c
 * A task whose step used none of the options is left alone and nothing is written.
 */

#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(pyxis_standin, 1);

#define MAX_ITEMS 64

static char *image, *workdir, *name, *save;
static char *mounts[MAX_ITEMS];
static int n_mounts;
static char *env_names[MAX_ITEMS];
static int n_env_names;
static char *unshare_ns;
static int mount_home = -1, remap_root = -1, entrypoint = -1, entrypoint_log = -1, writable = -1;
static char record_dir[1024];
static char image_files[4096];

/* One value per option: Slurm may hand the same option over twice, a different value is an error. */
static int set_once(char **slot, const char *what, const char *value)
{
	if (value == NULL || *value == '\0') {
		slurm_error("pyxis: --%s: argument required", what);
		return -1;
	}
	if (*slot != NULL)
		return strcmp(*slot, value) == 0 ? 0 : (slurm_error("pyxis: --%s specified multiple times", what), -1);
	*slot = strdup(value);
	return *slot == NULL ? -1 : 0;
}

static int set_flag(int *slot, int value, const char *what)
{
	if (*slot != -1 && *slot != value) {
		slurm_error("pyxis: both --%s and --no-%s were specified", what, what);
		return -1;
	}
	*slot = value;
	return 0;
}

static int is_path(const char *s)
{
	return s[0] == '/' || s[0] == '.';
}

/* SRC[:DST[:FLAGS]]: SRC a path, "tmpfs" or "umount"; DST a path (SRC when left out). */
static int valid_mount(const char *entry)
{
	const char *colon = strchr(entry, ':'), *dst = colon ? colon + 1 : entry;
	size_t src_len = colon ? (size_t)(colon - entry) : strlen(entry);

	if (src_len == 0 || *dst == '\0' || *dst == ':' || !is_path(dst))
		return 0;
	return is_path(entry) || (src_len == 5 && strncmp(entry, "tmpfs", 5) == 0) ||
	       (src_len == 6 && strncmp(entry, "umount", 6) == 0);
}

static int valid_env_name(const char *entry)
{
	return *entry != '\0';
}

/* A comma-separated option (mounts, variable names): each entry checked, kept once, in order. */
static int add_items(const char *what, const char *optarg, char **items, int *n, int (*valid)(const char *))
{
	char *copy, *rest, *entry;
	int rv = 0;

	if (optarg == NULL || *optarg == '\0') {
		slurm_error("pyxis: --%s: argument required", what);
		return -1;
	}
	copy = strdup(optarg);
	if (copy == NULL)
		return -1;
	rest = copy;
	while (rv == 0 && (entry = strsep(&rest, ",")) != NULL) {
		int known = 0;

		if (!valid(entry)) {
			slurm_error("pyxis: --%s: invalid format: %s", what, optarg);
			rv = -1;
			break;
		}
		for (int i = 0; i < *n; ++i)
			known |= strcmp(items[i], entry) == 0;
		if (!known && (*n == MAX_ITEMS || (items[*n] = strdup(entry)) == NULL))
			rv = -1;
		else if (!known)
			(*n)++;
	}
	free(copy);
	return rv;
}

static int opt_mounts(int val, const char *optarg, int remote)
{
	return add_items("container-mounts", optarg, mounts, &n_mounts, valid_mount);
}

static int opt_env(int val, const char *optarg, int remote)
{
	return add_items("container-env", optarg, env_names, &n_env_names, valid_env_name);
}

static int opt_name(int val, const char *optarg, int remote)
{
	const char *colon = optarg ? strchr(optarg, ':') : NULL;

	if (optarg != NULL && (optarg[0] == ':' || (colon && strcmp(colon + 1, "auto") != 0 &&
	    strcmp(colon + 1, "create") != 0 && strcmp(colon + 1, "exec") != 0 && strcmp(colon + 1, "no_exec") != 0))) {
		slurm_error("pyxis: --container-name: NAME[:auto|create|exec|no_exec]");
		return -1;
	}
	return set_once(&name, "container-name", optarg);
}

static int opt_image(int val, const char *optarg, int remote) { return set_once(&image, "container-image", optarg); }
static int opt_workdir(int val, const char *optarg, int remote) { return set_once(&workdir, "container-workdir", optarg); }
static int opt_save(int val, const char *optarg, int remote) { return set_once(&save, "container-save", optarg); }
static int opt_unshare(int val, const char *optarg, int remote) { return set_once(&unshare_ns, "container-unshare", optarg); }
static int opt_home(int val, const char *optarg, int remote) { return set_flag(&mount_home, val, "container-mount-home"); }
static int opt_remap(int val, const char *optarg, int remote) { return set_flag(&remap_root, val, "container-remap-root"); }
static int opt_entry(int val, const char *optarg, int remote) { return set_flag(&entrypoint, val, "container-entrypoint"); }
static int opt_entry_log(int val, const char *optarg, int remote) { entrypoint_log = val; return 0; }
static int opt_writable(int val, const char *optarg, int remote) { return set_flag(&writable, val, "container-writable"); }

/* pyxis's option names and argument forms; the help texts say they belong to this stand-in. */
static struct spank_option options[] = {
	{ "container-image", "[USER@][REGISTRY#]IMAGE[:TAG]|PATH", "[pyxis stand-in] image: enroot URI or squashfs path", 1, 0, opt_image },
	{ "container-mounts", "SRC:DST[:FLAGS][,SRC:DST...]", "[pyxis stand-in] bind mounts, flags joined by +", 1, 0, opt_mounts },
	{ "container-workdir", "PATH", "[pyxis stand-in] working directory inside the container", 1, 0, opt_workdir },
	{ "container-name", "NAME", "[pyxis stand-in] name the container is kept under on the node", 1, 0, opt_name },
	{ "container-save", "PATH", "[pyxis stand-in] save the container to a squashfs file", 1, 0, opt_save },
	{ "container-mount-home", NULL, "[pyxis stand-in] mount the user's home", 0, 1, opt_home },
	{ "no-container-mount-home", NULL, "[pyxis stand-in] do not mount the user's home", 0, 0, opt_home },
	{ "container-remap-root", NULL, "[pyxis stand-in] remap to root inside", 0, 1, opt_remap },
	{ "no-container-remap-root", NULL, "[pyxis stand-in] do not remap to root", 0, 0, opt_remap },
	{ "container-entrypoint", NULL, "[pyxis stand-in] run the image's entrypoint", 0, 1, opt_entry },
	{ "no-container-entrypoint", NULL, "[pyxis stand-in] do not run the image's entrypoint", 0, 0, opt_entry },
	{ "container-entrypoint-log", NULL, "[pyxis stand-in] print the entrypoint's output", 0, 1, opt_entry_log },
	{ "container-writable", NULL, "[pyxis stand-in] writable container filesystem", 0, 1, opt_writable },
	{ "container-readonly", NULL, "[pyxis stand-in] read-only container filesystem", 0, 0, opt_writable },
	{ "container-env", "NAME[,NAME...]", "[pyxis stand-in] variables kept from the host over the image's", 1, 0, opt_env },
	{ "container-unshare", "NS[,NS...]", "[pyxis stand-in] new namespaces (net, ipc, uts)", 1, 1, opt_unshare },
	SPANK_OPTIONS_TABLE_END
};

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();

	if (ctx != S_CTX_LOCAL && ctx != S_CTX_REMOTE && ctx != S_CTX_ALLOCATOR)
		return 0;  /* slurmd, prolog/epilog: no options there */
	for (int i = 0; i < ac; ++i)
		if (strncmp(av[i], "record_dir=", 11) == 0)
			snprintf(record_dir, sizeof(record_dir), "%s", av[i] + 11);
		else if (strncmp(av[i], "image_files=", 12) == 0)
			snprintf(image_files, sizeof(image_files), "%s", av[i] + 12);
	for (int i = 0; options[i].name != NULL; ++i) {
		spank_err_t rc = spank_option_register(sp, &options[i]);

		if (rc != ESPANK_SUCCESS) {
			slurm_error("pyxis stand-in: cannot register --%s: %s", options[i].name, spank_strerror(rc));
			return -1;
		}
	}
	return 0;
}


/* ---- the container: a mount namespace with enroot's fresh /tmp ------------------------------------ */

struct image_env {
	char *names[MAX_ITEMS], *values[MAX_ITEMS];
	int n;
};

static int read_image_env(const char *path, char **names, char **values, int max);

#define TMP_DIR "/tmp"
#define IMAGE_ENV_MAX 65536  /* the stand-in image's ENV lines are at its start; a real squashfs has none */

struct container {
	char key[320];           /* pyxis_<NAME> (scope global) or pyxis_<job>.<step> */
	const char *flags;       /* auto, create, exec, no_exec */
	ino_t ino;               /* the recorded mount namespace, 0 when none is recorded */
	char creator[64];        /* <job>.<step> that started it */
	char image[PATH_MAX];    /* its image ("-": none) */
	int joined;
};

static int under_tmp(const char *path)
{
	return strcmp(path, TMP_DIR) == 0 || strncmp(path, TMP_DIR "/", sizeof(TMP_DIR)) == 0;
}

/* mkdir -p (0755); the last component an empty file when leaf_file. */
static int make_path(const char *path, int leaf_file)
{
	char buf[PATH_MAX];
	int fd;

	if (snprintf(buf, sizeof(buf), "%s", path) >= (int)sizeof(buf))
		return -1;
	for (char *p = buf + 1; *p; ++p) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(buf, 0755) != 0 && errno != EEXIST)
			return -1;
		*p = '/';
	}
	if (!leaf_file)
		return mkdir(buf, 0755) != 0 && errno != EEXIST ? -1 : 0;
	fd = open(buf, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
	if (fd < 0)
		return -1;
	close(fd);
	return 0;
}

static ino_t mnt_ns(const char *pid)
{
	char path[64];
	struct stat st;

	snprintf(path, sizeof(path), "/proc/%s/ns/mnt", pid);
	return stat(path, &st) == 0 ? st.st_ino : 0;
}

/* A process inside mount namespace `ino`, 0 when none is left: whether the container is running
 * (what `enroot list -f` answers with its PID column). */
static pid_t running_in(ino_t ino)
{
	DIR *proc = opendir("/proc");
	struct dirent *e;
	pid_t found = 0;

	if (proc == NULL || ino == 0) {
		if (proc)
			closedir(proc);
		return 0;
	}
	while (found == 0 && (e = readdir(proc)) != NULL) {
		char *end;
		long pid = strtol(e->d_name, &end, 10);

		if (*end == '\0' && pid > 0 && mnt_ns(e->d_name) == ino)
			found = (pid_t)pid;
	}
	closedir(proc);
	return found;
}

static void read_container(int state_fd, struct container *c)
{
	int fd = openat(state_fd, c->key, O_RDONLY | O_CLOEXEC);
	FILE *f = fd < 0 ? NULL : fdopen(fd, "r");
	unsigned long ino = 0;

	c->ino = 0;
	if (f == NULL) {
		if (fd >= 0)
			close(fd);
		return;
	}
	if (fscanf(f, "%lu %63s %4095[^\n]", &ino, c->creator, c->image) == 3)
		c->ino = (ino_t)ino;
	fclose(f);
}

static int write_container(int state_fd, const struct container *c)
{
	char tmp[400];
	int fd;
	FILE *f;

	snprintf(tmp, sizeof(tmp), ".%s.%d", c->key, (int)getpid());
	fd = openat(state_fd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	f = fd < 0 ? NULL : fdopen(fd, "w");
	if (f == NULL)
		return -1;
	fprintf(f, "%lu %s %s\n", (unsigned long)c->ino, c->creator, c->image);
	if (fclose(f) != 0)
		return -1;
	return renameat(state_fd, tmp, state_fd, c->key);
}

/* A detached copy of the mount tree at `path` (open_tree): what a bind of it shows, taken before /tmp
 * is covered (a bind made later would carry the new tmpfs along where it covers the source). */
static int clone_tree(const char *path)
{
	return open_tree(AT_FDCWD, path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
}

/* Attach `tree_fd` (clone_tree) at `dst`, read-only when the mount's flags (joined by +) hold "ro". */
static int bind_at(int tree_fd, const char *dst, const char *flags)
{
	struct stat st;

	if (fstat(tree_fd, &st) != 0 || (under_tmp(dst) && make_path(dst, !S_ISDIR(st.st_mode)) != 0))
		return -1;
	if (move_mount(tree_fd, "", AT_FDCWD, dst, MOVE_MOUNT_F_EMPTY_PATH) != 0)
		return -1;
	if (flags != NULL) {
		char copy[256], *rest = copy, *flag;

		snprintf(copy, sizeof(copy), "%s", flags);
		while ((flag = strsep(&rest, "+")) != NULL)
			if (strcmp(flag, "ro") == 0 && mount(NULL, dst, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL) != 0)
				return -1;
	}
	return 0;
}

/* Start the container: a new mount namespace, enroot's tmpfs on /tmp, the image's own files under
 * /tmp (image_files), then the --container-mounts. Targets outside /tmp that the host lacks are listed
 * in `unmounted` (there is no image root filesystem to create them in). */
static int start_container(char **unmounted, int *n_unmounted)
{
	int src_fds[MAX_ITEMS], file_fds[MAX_ITEMS], n_files = 0, rv = -1;
	char *file_paths[MAX_ITEMS], files[sizeof(image_files)], *rest = files, *path;

	for (int i = 0; i < n_mounts; ++i)
		src_fds[i] = -1;
	if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) != 0) {
		slurm_error("pyxis stand-in: cannot make the container's mount namespace: %s", strerror(errno));
		goto out;
	}
	/* The sources, cloned in the new namespace before its /tmp is covered. */
	for (int i = 0; i < n_mounts; ++i) {
		char src[PATH_MAX];
		size_t len = strcspn(mounts[i], ":");

		snprintf(src, sizeof(src), "%.*s", (int)len, mounts[i]);
		if (strcmp(src, "tmpfs") == 0 || strcmp(src, "umount") == 0)
			continue;
		src_fds[i] = clone_tree(src);
		if (src_fds[i] < 0) {
			slurm_error("pyxis: mount source %s: %s", src, strerror(errno));
			goto out;
		}
	}
	snprintf(files, sizeof(files), "%s", image_files);
	while ((path = strsep(&rest, ":")) != NULL && n_files < MAX_ITEMS) {
		if (*path == '\0' || !under_tmp(path) || (file_fds[n_files] = clone_tree(path)) < 0)
			continue;
		file_paths[n_files++] = path;
	}
	if (mount("tmpfs", TMP_DIR, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755") != 0) {
		slurm_error("pyxis stand-in: cannot mount the container's /tmp: %s", strerror(errno));
		goto out;
	}
	for (int i = 0; i < n_files; ++i)
		if (bind_at(file_fds[i], file_paths[i], NULL) != 0) {
			slurm_error("pyxis stand-in: cannot mount the image's %s: %s", file_paths[i], strerror(errno));
			goto out;
		}
	for (int i = 0; i < n_mounts; ++i) {
		char entry[PATH_MAX], *colon, *dst, *flags;

		snprintf(entry, sizeof(entry), "%s", mounts[i]);
		colon = strchr(entry, ':');
		dst = colon ? colon + 1 : entry;
		if (colon)
			*colon = '\0';
		flags = strchr(dst, ':');
		if (flags)
			*flags++ = '\0';
		if (!under_tmp(dst) && access(dst, F_OK) != 0) {
			unmounted[(*n_unmounted)++] = mounts[i];
			continue;
		}
		if (strcmp(entry, "umount") == 0 ? umount2(dst, MNT_DETACH) != 0 :
		    strcmp(entry, "tmpfs") == 0 ? (under_tmp(dst) && make_path(dst, 0) != 0) ||
						  mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755") != 0 :
		    bind_at(src_fds[i], dst, flags) != 0) {
			slurm_error("pyxis: cannot mount %s: %s", mounts[i], strerror(errno));
			goto out;
		}
	}
	rv = 0;
out:
	for (int i = 0; i < n_mounts; ++i)
		if (src_fds[i] >= 0)
			close(src_fds[i]);
	for (int i = 0; i < n_files; ++i)
		close(file_fds[i]);
	return rv;
}

/* Find, join or start the task's container (pyxis_slurmstepd.c: slurm_spank_user_init's decision,
 * taken under a lock so that every task of a step on a node ends up in one container). */
static int enter_container(int state_fd, const char *step_key, struct container *c, char **unmounted,
			   int *n_unmounted, struct image_env *env)
{
	char lock_name[340];
	int lock_fd, rv = -1;
	pid_t pid;

	snprintf(lock_name, sizeof(lock_name), ".%s.lock", c->key);
	lock_fd = openat(state_fd, lock_name, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
	if (lock_fd < 0 || flock(lock_fd, LOCK_EX) != 0) {
		slurm_error("pyxis stand-in: cannot lock container %s: %s", c->key, strerror(errno));
		goto out;
	}
	read_container(state_fd, c);
	/* the image's ENV, read on the host (a joined container without --container-image: its own image) */
	env->n = read_image_env(image ? image : c->image, env->names, env->values, MAX_ITEMS - 2);
	/* pyxis: -1 no such container, 0 it exists and runs nothing, >0 a PID inside it */
	pid = c->ino == 0 ? -1 : running_in(c->ino);
	if (pid > 0 && strcmp(c->creator, step_key) == 0) {
		;  /* a later task of the step that started it: pyxis's tasks share the first task's container */
	} else if (strcmp(c->flags, "create") == 0 && pid >= 0) {
		slurm_error("pyxis: error: \"create\" flag was passed to --container-name but the container already exists");
		goto out;
	} else if (strcmp(c->flags, "exec") == 0 && pid <= 0) {
		slurm_error("pyxis: error: \"exec\" flag was passed to --container-name but the container is not running");
		goto out;
	} else if (strcmp(c->flags, "no_exec") == 0 && pid > 0) {
		pid = 0;
	}
	if (pid < 0 && image == NULL) {
		slurm_error("pyxis: error: a container with name \"%s\" does not exist, and --container-image is not set",
			    c->key);
		goto out;
	}
	if (pid > 0) {
		char ns[64];
		int ns_fd;

		if (n_mounts > 0 && strcmp(c->creator, step_key) != 0)
			slurm_spank_log("pyxis: ignoring --container-mounts when attaching to a running container");
		snprintf(ns, sizeof(ns), "/proc/%d/ns/mnt", (int)pid);
		ns_fd = open(ns, O_RDONLY | O_CLOEXEC);
		if (ns_fd < 0 || setns(ns_fd, CLONE_NEWNS) != 0) {
			slurm_error("pyxis: couldn't join mount namespace of %s: %s", c->key, strerror(errno));
			if (ns_fd >= 0)
				close(ns_fd);
			goto out;
		}
		close(ns_fd);
		c->joined = strcmp(c->creator, step_key) != 0;
		rv = 0;
		goto out;
	}
	if (start_container(unmounted, n_unmounted) != 0)
		goto out;
	c->ino = mnt_ns("self");
	snprintf(c->creator, sizeof(c->creator), "%s", step_key);
	if (image != NULL)  /* a container reused without --container-image keeps its image */
		snprintf(c->image, sizeof(c->image), "%s", image);
	if (write_container(state_fd, c) != 0) {
		slurm_error("pyxis stand-in: cannot record container %s: %s", c->key, strerror(errno));
		goto out;
	}
	rv = 0;
out:
	if (lock_fd >= 0)
		close(lock_fd);
	return rv;
}

/* ---- the environment -------------------------------------------------------------------------------- */

static int listed(const char *var)
{
	for (int i = 0; i < n_env_names; ++i)
		if (strcmp(env_names[i], var) == 0)
			return 1;
	return 0;
}

/* The image's ENV: NAME=VALUE lines of the stand-in image file (none for a registry image). */
static int read_image_env(const char *path, char **names, char **values, int max)
{
	char line[4096];
	int n = 0;
	FILE *f;

	if (path == NULL || strcmp(path, "-") == 0 || (path[0] != '/' && path[0] != '.') || (f = fopen(path, "re")) == NULL)
		return 0;
	while (n < max && ftell(f) < IMAGE_ENV_MAX && fgets(line, sizeof(line), f) != NULL) {
		char *eq = strchr(line, '=');
		size_t len = strcspn(line, "\n");

		line[len] = '\0';
		if (eq == NULL || eq == line || strspn(line, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
		    != (size_t)(eq - line) || (line[0] >= '0' && line[0] <= '9'))
			continue;
		*eq = '\0';
		names[n] = strdup(line);
		values[n] = strdup(eq + 1);
		if (names[n] == NULL || values[n] == NULL) {
			free(names[n]);
			free(values[n]);
			break;
		}
		n++;
	}
	fclose(f);
	return n;
}

/* spank_import_container_env, then pytorch_setup. */
static int import_env(spank_t sp, const struct image_env *env)
{
	static const char *deny[] = { "LANG", "LANGUAGE", "LC_ALL", NULL };
	char buf[256];

	for (int i = 0; deny[i] != NULL; ++i)
		if (!listed(deny[i]))
			spank_unsetenv(sp, deny[i]);
	for (int i = 0; i < env->n; ++i) {
		spank_err_t rc = spank_setenv(sp, env->names[i], env->values[i], !listed(env->names[i]));

		if (rc != ESPANK_SUCCESS && rc != ESPANK_ENV_EXISTS) {
			slurm_error("pyxis: failed to set %s: %s", env->names[i], spank_strerror(rc));
			return -1;
		}
	}
	if (spank_getenv(sp, "PYTORCH_VERSION", buf, sizeof(buf)) != ESPANK_SUCCESS)
		return 0;
	if (spank_getenv(sp, "SLURM_PROCID", buf, sizeof(buf)) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "RANK", buf, 1) != ESPANK_SUCCESS ||
	    spank_getenv(sp, "SLURM_LOCALID", buf, sizeof(buf)) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "LOCAL_RANK", buf, 1) != ESPANK_SUCCESS) {
		slurm_error("pyxis: pytorch: couldn't remap SLURM_PROCID/SLURM_LOCALID");
		return -1;
	}
	return 0;
}

/* ---- the record ------------------------------------------------------------------------------------- */

static void json_string(FILE *f, const char *s)
{
	if (s == NULL) {
		fputs("null", f);
		return;
	}
	fputc('"', f);
	for (; *s; ++s) {
		if (*s == '"' || *s == '\\')
			fprintf(f, "\\%c", *s);
		else if ((unsigned char)*s < 0x20)
			fprintf(f, "\\u%04x", (unsigned char)*s);
		else
			fputc(*s, f);
	}
	fputc('"', f);
}

static void json_list(FILE *f, char **items, int n)
{
	fputc('[', f);
	for (int i = 0; i < n; ++i) {
		if (i)
			fputc(',', f);
		json_string(f, items[i]);
	}
	fputc(']', f);
}

/* "NAME": value as the task will see it (null: unset), for each name. */
static void json_env(FILE *f, spank_t sp, char **names, int n, int *first)
{
	char value[4096];

	for (int i = 0; i < n; ++i) {
		fputs(*first ? "" : ",", f);
		*first = 0;
		json_string(f, names[i]);
		fputc(':', f);
		json_string(f, spank_getenv(sp, names[i], value, sizeof(value)) == ESPANK_SUCCESS ? value : NULL);
	}
}

static int write_record(int record_fd, spank_t sp, const char *node, const struct container *c,
			char **image_names, int n_image_names, char **unmounted, int n_unmounted)
{
	static char *torch_names[] = { "RANK", "LOCAL_RANK" };
	uint32_t job = 0, step = 0, task = 0;
	int argc = 0, first = 1, fd;
	char **argv = NULL;
	char het_job[32] = "", name_buf[300], tmp[310];
	FILE *f;

	spank_get_item(sp, S_JOB_ID, &job);
	spank_get_item(sp, S_JOB_STEPID, &step);
	spank_get_item(sp, S_TASK_GLOBAL_ID, &task);
	spank_get_item(sp, S_JOB_ARGV, &argc, &argv);
	spank_getenv(sp, "SLURM_HET_JOB_ID", het_job, sizeof(het_job));
	snprintf(name_buf, sizeof(name_buf), "%u.%u.%s.%u.json", job, step, node, task);
	snprintf(tmp, sizeof(tmp), ".%s.tmp", name_buf);
	fd = openat(record_fd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	f = fd < 0 ? NULL : fdopen(fd, "w");
	if (f == NULL) {
		slurm_error("pyxis stand-in: cannot write %s/%s: %s", record_dir, tmp, strerror(errno));
		return -1;
	}
	fprintf(f, "{\"job_id\":%u,\"het_job_id\":", job);
	json_string(f, het_job[0] ? het_job : NULL);
	fprintf(f, ",\"step_id\":%u,\"task\":%u,\"node\":", step, task);
	json_string(f, node);
	fputs(",\"image\":", f);
	json_string(f, image);
	fputs(",\"mounts\":", f);
	json_list(f, mounts, n_mounts);
	fputs(",\"name\":", f);
	json_string(f, name);
	fputs(",\"container\":", f);
	json_string(f, c->key);
	fprintf(f, ",\"joined\":%s,\"unmounted\":", c->joined ? "true" : "false");
	json_list(f, unmounted, n_unmounted);
	fputs(",\"workdir\":", f);
	json_string(f, workdir);
	fputs(",\"env\":", f);
	json_list(f, env_names, n_env_names);
	fputs(",\"environ\":{", f);
	json_env(f, sp, image_names, n_image_names, &first);
	json_env(f, sp, env_names, n_env_names, &first);
	json_env(f, sp, torch_names, 2, &first);
	fprintf(f, "},\"mount_home\":%d,\"remap_root\":%d,\"entrypoint\":%d,\"writable\":%d,\"argv\":",
		mount_home, remap_root, entrypoint, writable);
	json_list(f, argv, argc);
	fputs("}\n", f);
	if (fclose(f) != 0 || renameat(record_fd, tmp, record_fd, name_buf) != 0) {
		slurm_error("pyxis stand-in: cannot write %s/%s: %s", record_dir, name_buf, strerror(errno));
		return -1;
	}
	return 0;
}

/* ---- each task, before it execs ---------------------------------------------------------------------- */

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	uint32_t job = 0, step = 0;
	char node[256] = "", step_key[64], cwd[PATH_MAX] = "", state[1400];
	char *unmounted[MAX_ITEMS];
	int n_unmounted = 0, record_fd = -1, state_fd = -1, rv = -1;
	struct image_env env = { .n = 0 };
	struct container c = { .flags = "auto", .image = "-" };

	if (!spank_remote(sp) || (image == NULL && name == NULL) || record_dir[0] == '\0')
		return 0;
	spank_get_item(sp, S_JOB_ID, &job);
	spank_get_item(sp, S_JOB_STEPID, &step);
	if (spank_getenv(sp, "SLURMD_NODENAME", node, sizeof(node)) != ESPANK_SUCCESS)
		gethostname(node, sizeof(node) - 1);
	snprintf(step_key, sizeof(step_key), "%u.%u", job, step);
	if (name != NULL) {
		const char *colon = strchr(name, ':');

		snprintf(c.key, sizeof(c.key), "pyxis_%.*s", (int)(colon ? colon - name : (long)strlen(name)), name);
		c.flags = colon ? colon + 1 : "auto";
	} else {
		snprintf(c.key, sizeof(c.key), "pyxis_%s", step_key);
	}
	/* host paths, opened before the task's /tmp is replaced: the records and the containers' state */
	snprintf(state, sizeof(state), "%s/containers/%s", record_dir, node);
	if (getcwd(cwd, sizeof(cwd)) == NULL)
		snprintf(cwd, sizeof(cwd), "/");
	record_fd = open(record_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (record_fd < 0 || make_path(state, 0) != 0 || (state_fd = open(state, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
		slurm_error("pyxis stand-in: cannot open %s: %s", state, strerror(errno));
		goto out;
	}
	if (enter_container(state_fd, step_key, &c, unmounted, &n_unmounted, &env) != 0)
		goto out;
	if (chdir(workdir ? workdir : cwd) != 0) {
		slurm_error("pyxis: couldn't chdir to %s: %s", workdir ? workdir : cwd, strerror(errno));
		goto out;
	}
	if (import_env(sp, &env) != 0)
		goto out;
	rv = write_record(record_fd, sp, node, &c, env.names, env.n, unmounted, n_unmounted);
out:
	for (int i = 0; i < env.n; ++i) {
		free(env.names[i]);
		free(env.values[i]);
	}
	if (record_fd >= 0)
		close(record_fd);
	if (state_fd >= 0)
		close(state_fd);
	return rv;
}
