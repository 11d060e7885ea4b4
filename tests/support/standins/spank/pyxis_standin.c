/*
 * A stand-in for NVIDIA's pyxis SPANK plugin, for beam-hpc's tests on the local Slurm cluster.
 *
 * pyxis and enroot cannot run where the tests run, but Slurm's SPANK interface can. This plugin
 * registers the srun/sbatch options pyxis registers (the names, argument forms and flag values of
 * pyxis 0.24.0's option table, args.c), checks their arguments by pyxis's documented rules, and on
 * each node writes one JSON file per task saying what the task received. It starts NO container:
 * the task runs on the host as it is. That is the end of the seam beam-hpc tests
 * (beam_hpc/node/container.py): that Slurm accepts every option beam-hpc passes and that each step
 * gets the image, the mounts and the container name.
 *
 * plugstack.conf:  optional /path/pyxis_standin.so record_dir=/some/dir
 * Build (CI):      gcc -shared -fPIC -Wall -Werror -o pyxis_standin.so pyxis_standin.c
 * A task whose step used none of the options is left alone and nothing is written.
 */

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(pyxis_standin, 1);

#define MAX_ITEMS 64

static char *image, *workdir, *name, *save;
static char *mounts[MAX_ITEMS];
static int n_mounts;
static char *env_names[MAX_ITEMS];
static int n_env_names;
static char *unshare;
static int mount_home = -1, remap_root = -1, entrypoint = -1, entrypoint_log = -1, writable = -1;
static char record_dir[1024];

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
static int opt_unshare(int val, const char *optarg, int remote) { return set_once(&unshare, "container-unshare", optarg); }
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
	for (int i = 0; options[i].name != NULL; ++i) {
		spank_err_t rc = spank_option_register(sp, &options[i]);

		if (rc != ESPANK_SUCCESS) {
			slurm_error("pyxis stand-in: cannot register --%s: %s", options[i].name, spank_strerror(rc));
			return -1;
		}
	}
	return 0;
}

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

/* In each task, before it execs: record what it received (only when a container was asked for). */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	uint32_t job = 0, step = 0, task = 0;
	int argc = 0;
	char **argv = NULL;
	char node[256] = "", het_job[32] = "", path[1400], tmp[1408];
	FILE *f;

	if (!spank_remote(sp) || (image == NULL && name == NULL) || record_dir[0] == '\0')
		return 0;
	spank_get_item(sp, S_JOB_ID, &job);
	spank_get_item(sp, S_JOB_STEPID, &step);
	spank_get_item(sp, S_TASK_GLOBAL_ID, &task);
	spank_get_item(sp, S_JOB_ARGV, &argc, &argv);
	if (spank_getenv(sp, "SLURMD_NODENAME", node, sizeof(node)) != ESPANK_SUCCESS)
		gethostname(node, sizeof(node) - 1);
	spank_getenv(sp, "SLURM_HET_JOB_ID", het_job, sizeof(het_job));
	snprintf(path, sizeof(path), "%s/%u.%u.%s.%u.json", record_dir, job, step, node, task);
	snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	f = fopen(tmp, "w");
	if (f == NULL) {
		slurm_error("pyxis stand-in: cannot write %s: %s", tmp, strerror(errno));
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
	fputs(",\"workdir\":", f);
	json_string(f, workdir);
	fputs(",\"env\":", f);
	json_list(f, env_names, n_env_names);
	fprintf(f, ",\"mount_home\":%d,\"remap_root\":%d,\"entrypoint\":%d,\"writable\":%d,\"argv\":",
		mount_home, remap_root, entrypoint, writable);
	json_list(f, argv, argc);
	fputs("}\n", f);
	if (fclose(f) != 0 || rename(tmp, path) != 0) {
		slurm_error("pyxis stand-in: cannot write %s: %s", path, strerror(errno));
		return -1;
	}
	return 0;
}
